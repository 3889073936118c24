"""dLLM-Cache (`dllm_cache`: maomaocun/dLLM-cache @ 17235bf, `dllm_cache/hooks/cache_hook_LLaDA.py`,
`dllm_cache/cache/Cache.py`): per layer, the K/V and both sublayers' outputs of every position, refreshed on a schedule
of passes, the response's least stable positions recomputed in between.

Per row (each row counts its own passes, so it decodes as it does alone):
  - What is kept, per layer: every position's keys and values, the attention sublayer's output (after its output
    projection) and the feed-forward sublayer's output (after its down projection). The residual stream is never
    kept: each layer adds the (fresh or kept) attention output to its input, and the (fresh or kept) feed-forward
    output to that.
  - Pass n = 1, 2, ... (from the start of the row's generation, across blocks) refreshes the prompt in layers >= 1
    when (n - 1) % prompt_interval == 0 and the response (the whole generated region) when (n - 1) % gen_interval
    == 0. Layer 0 is computed in full on every pass (the authors' fix).
  - A refreshed part's queries, keys and values are fresh and its kept quantities replaced; its queries attend over
    the fresh K/V of refreshed parts and the kept ones of the others.
  - Where the response is not refreshed and transfer_ratio > 0, the values of ALL response positions are recomputed
    (and kept); the int(G * transfer_ratio) positions whose fresh value has the lowest cosine similarity with the
    kept one get fresh queries and keys, a fresh attention output (over every key, the fresh values) and a fresh
    feed-forward output; the other positions keep their key and outputs. transfer_ratio 0: the response comes
    wholly from what is kept.
  - The authors attend to padding (no attention mask); here a row sees only its own tokens (each row of a left-padded
    batch equals itself alone).

Every pass is one forward (NFE); the pass count equals the no-cache loop's. The layers run in this module's own loop
over the model's pure pieces (model.attention_inputs, attention_output, feed_forward): layer 0 over the whole canvas,
layers >= 1 over each row's fresh positions only (the prompt if refreshed, the response if refreshed, else its picked
positions) at the smallest of a few static widths that holds every row's, plus the value projection of the response.
prompt_interval and gen_interval are traced per row; transfer_ratio fixes how many positions a pass recomputes
(int(G * transfer_ratio)): static.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.decode.cache.passes import embed, needs_layers, pick_width, subset_of
from localleap_jax.decode.cache.protocol import Hidden, PolicyBase, from_full, per_row, setting, static_setting
from localleap_jax.decode.canvas import rows_take
from localleap_jax.model import (attention, attention_inputs, attention_output, feed_forward, layer_kinds, linear,
                                 norm)


class Kept(NamedTuple):
    """Per layer [B, L, ...]: keys, values (after RoPE, as the model's cache holds them), both sublayers' outputs."""

    k: tuple
    v: tuple
    attn: tuple
    ffn: tuple


class DllmState(NamedTuple):
    kept: Kept
    passes: Int[Array, "B"]  # the row's passes so far


def cosine(a: Float[Array, "B G K H"], b: Float[Array, "B G K H"]) -> Float[Array, "B G"]:
    """torch.nn.functional.cosine_similarity over each position's values (eps 1e-8)."""
    a = a.reshape(a.shape[:2] + (-1,)).astype(jnp.float32)
    b = b.reshape(b.shape[:2] + (-1,)).astype(jnp.float32)
    dot = jnp.sum(a * b, axis=-1)
    return dot / jnp.sqrt(jnp.maximum(jnp.sum(a * a, axis=-1) * jnp.sum(b * b, axis=-1), 1e-16))


def scatter(kept: Array, idx: Int[Array, "B C"], valid: Bool[Array, "B C"], new: Array) -> Array:
    """kept with new[b, c] at position idx[b, c] where valid."""
    B, L = kept.shape[:2]
    dest = jnp.where(valid, idx, L)
    return kept.at[jnp.arange(B)[:, None], dest].set(new.astype(kept.dtype), mode="drop")


@struct.dataclass
class DllmCache(PolicyBase):
    prompt_interval: int = setting(50, int, low=1)
    gen_interval: int = setting(7, int, low=1)
    transfer_ratio: float = static_setting(0.25, float, low=0.0, high=1.0)

    name: ClassVar[str] = "dllm_cache"
    computes: ClassVar[str] = "layers (layer 0 whole; then refreshed parts and the least stable response positions)"
    keeps: ClassVar[str] = "kv and both sublayer outputs, per layer"
    refreshes: ClassVar[str] = "schedule (prompt_interval, gen_interval passes)"
    region: ClassVar[bool] = True

    def picked_count(self, gen_length: int) -> int:
        return int(gen_length * float(self.transfer_ratio))

    def init(self, denoiser, canvas):
        params, c = needs_layers(denoiser, self.name)
        B, L = canvas.batch, canvas.length
        dtype = params["wte"]["embedding"].dtype
        kv = tuple(jnp.zeros((B, L, c.n_kv_heads, c.head_dim), dtype) for _ in range(c.n_layers))
        out = tuple(jnp.zeros((B, L, c.d_model), dtype) for _ in range(c.n_layers))
        return DllmState(Kept(kv, kv, out, out), jnp.zeros((B,), jnp.int32))

    def refill(self, denoiser, canvas, state, rows):
        return state._replace(passes=jnp.where(rows, 0, state.passes))

    def forward(self, denoiser, canvas, x, block, state, view):
        params, c = needs_layers(denoiser, self.name)
        B, L, P, G = canvas.batch, canvas.length, canvas.prompt_length, canvas.gen_length
        n = state.passes + 1  # this pass's number
        working = ~view.done
        refresh_p = working & ((n - 1) % jnp.maximum(per_row(self.prompt_interval, n), 1) == 0)
        refresh_r = working & ((n - 1) % jnp.maximum(per_row(self.gen_interval, n), 1) == 0)
        K = self.picked_count(G)
        adaptive = float(self.transfer_ratio) > 0
        kinds = layer_kinds(c)
        response = jnp.arange(L) >= P

        # layer 0: every position, every pass
        h = embed(params, x)
        everything = jnp.broadcast_to(jnp.arange(L), (B, L))
        h, first = self.layer(params["layers"][0], kinds[0], c, canvas, h, everything, jnp.ones((B, L), bool),
                              None, None)
        kept = [first]

        # layers >= 1 over each row's fresh positions, at one width for the pass
        sizes = sorted({max(K, 1), G, P + max(K, 1), L})
        count = jnp.max(jnp.where(refresh_p, P, 0) + jnp.where(refresh_r, G, K))

        def at_width(W: int):
            def go(h):
                outs = []
                for i in range(1, c.n_layers):
                    old = tuple(part[i] for part in state.kept)
                    h, new = self.partial_layer(params["layers"][i], kinds[i], c, canvas, h, old, refresh_p,
                                                refresh_r, W, K if adaptive else 0, adaptive, response)
                    outs.append(new)
                return h, outs
            return go

        h, rest = jax.lax.switch(pick_width(count, tuple(sizes)), [at_width(W) for W in sizes], h)
        kept += rest
        kept = [tuple(jnp.where(working.reshape((B,) + (1,) * (a.ndim - 1)), a, b) for a, b in zip(new, old))
                for new, old in zip(kept, zip(*state.kept))]  # a finished row keeps what it had
        state = state._replace(kept=Kept(*(tuple(layer[j] for layer in kept) for j in range(4))))
        h_block, h_region = from_full(h, canvas, block, view.want_region)
        return Hidden(h_block, h_region, state, full=refresh_p & refresh_r)

    def layer(self, p, moe, c, canvas, h, idx, fresh, old, v_used):
        """A layer whose positions idx (fresh) are computed, the others (when `old`) kept: (h after the layer over
        every position, the layer's kept (k, v, attn, ffn))."""
        positions = rows_take(canvas.positions, idx)
        h_sub = rows_take(h, idx)
        q, k, v = attention_inputs(p, h_sub, positions, c)
        if old is None:  # every position fresh
            k_used, v_used = k, v
            o = attention(q, k, v, canvas.key_mask)
            attn = attention_output(p, o)
            h = h + attn
            ffn = feed_forward(p, h, c, moe)
            return h + ffn, (k, v, attn, ffn)
        k_used = scatter(old[0], idx, fresh, k)
        v_used = scatter(v_used, idx, fresh, v)
        o = attention(q, k_used, v_used, canvas.key_mask)
        attn = scatter(old[2], idx, fresh, attention_output(p, o))
        h = h + attn
        ffn = scatter(old[3], idx, fresh, feed_forward(p, rows_take(h, idx), c, moe))
        return h + ffn, (k_used, v_used, attn, ffn)

    def partial_layer(self, p, moe, c, canvas, h, old, refresh_p, refresh_r, width: int, K: int, adaptive: bool,
                      response: Bool[Array, "L"]):
        B, L, P = canvas.batch, canvas.length, canvas.prompt_length
        v_used = old[1]
        fresh = (~response[None, :] & refresh_p[:, None]) | (response[None, :] & refresh_r[:, None])
        if adaptive:  # every response value recomputed; the least similar to the kept ones get fresh outputs
            hn = norm(p["attn_norm"], h[:, P:], c.rms_norm_eps)
            v_r = linear(p["v_proj"], hn).reshape(B, L - P, c.n_kv_heads, c.head_dim)
            similarity = cosine(v_r, old[1][:, P:])
            if K:
                order = jnp.argsort(similarity, axis=1, stable=True)[:, :K]  # the K least similar
                least = jnp.zeros((B, L - P), bool).at[jnp.arange(B)[:, None], order].set(True)
                fresh = fresh | (jnp.pad(least, ((0, 0), (P, 0))) & ~refresh_r[:, None])
            v_used = v_used.at[:, P:].set(jnp.where(refresh_r[:, None, None, None], v_used[:, P:],
                                                    v_r.astype(v_used.dtype)))
        idx, valid = subset_of(fresh, width)
        return self.layer(p, moe, c, canvas, h, idx, valid, old, v_used)

    def update(self, denoiser, state, outcome):
        return state._replace(passes=state.passes + outcome.step.working.astype(jnp.int32))
