"""The diffusion LM transformer (LLaDA, Dream and SDAR) in Flax Linen.

A Llama block: RMSNorm -> attention with RoPE -> residual, RMSNorm -> SwiGLU -> residual; final RMSNorm and
an LM head. The families differ only in configuration: Dream (a Qwen2.5 block) adds biases to the q/k/v
projections and uses its own norm eps and RoPE theta, and its logits lag by one position
(`ModelConfig.logits_shift`), which `forward` applies and `trunk`/`head` leave to the caller. SDAR (a Qwen3
block) normalises each head of q and k before RoPE, may tie its head to the embedding, and attends
block-causally (`ModelConfig.block_size`): a query sees the keys of its own block and of earlier ones, on
each row's grid from its first real token. LLaDA and Dream attend bidirectionally.

Why Linen: parameters are a plain pytree, so Orbax saves and restores them as-is, `pmap`
replicates them and `lax.while_loop` closes over them without any split/merge step, and
`nn.scan` stacks the layers ([n_layers, ...] leaves) so compile time does not grow with depth.

Precision: weights and matmuls in the parameter dtype (bf16 by default); RMSNorm, RoPE and
the attention softmax in fp32; logits returned in fp32.

Boundary functions (all pure; jitted with the config static, so a call outside a compiled program compiles
once per shape instead of dispatching op by op, and inside one it simply inlines):
  forward(params, tokens, mask, config)            -> logits [B, L, V], logit i scoring token i
                                                       (shifted for Dream)
  trunk(params, tokens, positions, key_mask, ...)  -> hidden [B, L, D] (+ per-layer K/V)
  trunk_cached(...)                                 -> hidden for a window of queries that
                                                       read the other positions' K/V from a cache
  trunk_stored(...)                                 -> the same, and the cache with the window's K/V
  head(params, hidden)                              -> logits for only the positions given
                                                       (per hidden position: never shifted)
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.config import ModelConfig
from localleap_jax.moe import MoELayers, expert_mesh, moe_layer

Params = dict  # the Linen parameter tree: {"wte", "blocks", "ln_f", "ff_out"} (q/k/v "bias" with qkv_bias,
# "q_norm"/"k_norm" with qk_norm, no "ff_out" with a tied head)


class KVCache(NamedTuple):
    """Keys and values of every layer at every canvas position (after RoPE)."""

    k: Float[Array, "N B L K H"]
    v: Float[Array, "N B L K H"]


class CacheWrite(NamedTuple):
    """Where a window of queries sits in the canvas, and which of its K/V replace the cache."""

    start: Int[Array, "B"]  # canvas index of the window's first position, per row
    fresh: Bool[Array, "B Q"]  # True: use this step's K/V at that position; False: keep the cache


# ---------------------------------------------------------------- pure building blocks


def rms_norm(x: Float[Array, "... D"], scale: Float[Array, "D"], eps: float) -> Float[Array, "... D"]:
    # Normalise in fp32 and scale in the input dtype, as LLaDA (and HF Llama) do.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return scale * x32.astype(x.dtype)


def rope(x: Float[Array, "B T N H"], positions: Int[Array, "B T"], theta: float, rotary_dim: int | None = None
         ) -> Float[Array, "B T N H"]:
    """Rotate-half (NeoX-style) rotary embedding computed in fp32, on the first `rotary_dim` dims of each head (None:
    all of them; partial rotary, LLaDA2: the frequencies are those of a head of `rotary_dim`, the rest passes)."""
    rd = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, rd, 2, dtype=np.float32) / rd))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rd/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, rd]
    x32 = x.astype(jnp.float32)
    rot, rest = x32[..., :rd], x32[..., rd:]
    x1, x2 = jnp.split(rot, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = rot * jnp.cos(angles) + rotated * jnp.sin(angles)
    return (out if rd == x.shape[-1] else jnp.concatenate([out, rest], axis=-1)).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def attention_implementation(dtype_name: str, head_dim: int) -> str:
    """'cudnn' where a probe compile on this GPU accepts our dtype/head size/mask, else 'xla'.

    Override with LOCALLEAP_ATTENTION=xla|cudnn.
    """
    forced = os.environ.get("LOCALLEAP_ATTENTION")
    if forced in ("xla", "cudnn"):
        return forced
    if jax.default_backend() != "gpu" or dtype_name not in ("bfloat16", "float16") or head_dim > 128:
        return "xla"
    q = jax.ShapeDtypeStruct((1, 64, 2, head_dim), jnp.dtype(dtype_name))
    m = jax.ShapeDtypeStruct((1, 1, 1, 64), jnp.bool_)
    probe = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"))
    try:
        probe.lower(q, q, q, mask=m).compile()
        return "cudnn"
    except Exception:  # cuDNN missing, too old, or this shape/dtype unsupported
        return "xla"


def attention(q: Float[Array, "B T N H"], k: Float[Array, "B S K H"], v: Float[Array, "B S K H"],
              mask: Bool[Array, "B #T S"]) -> Float[Array, "B T N H"]:
    """Attention where mask[b, t, s] says query t may see key s (a [B, S] key mask: every query alike;
    softmax in fp32)."""
    if mask.ndim == 2:
        mask = mask[:, None, :]
    # The cuDNN probe covers a key-padding mask only; a block-causal one takes XLA's path.
    impl = attention_implementation(jnp.dtype(q.dtype).name, q.shape[-1]) if mask.shape[1] == 1 else "xla"
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation=impl)


def attention_mask(query_positions: Int[Array, "B T"], key_mask: Bool[Array, "B S"], block_size: int
                   ) -> Bool[Array, "B #T S"]:
    """Which keys each query sees: every real key (block_size 0), or the real keys of its own block and
    earlier ones on the row's grid (block diffusion). Key positions follow from the key mask (the canvas'
    RoPE positions start at each row's first real token), so a window of queries needs no more than this."""
    if not block_size:
        return key_mask[:, None, :]
    key_block = positions_from_mask(key_mask) // block_size
    return key_mask[:, None, :] & (key_block[:, None, :] <= (query_positions // block_size)[:, :, None])


def positions_from_mask(mask: Bool[Array, "B L"]) -> Int[Array, "B L"]:
    """RoPE positions that start at 0 on each row's first real token (left padding ignored)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


# ---------------------------------------------------------------- Linen modules

_init = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale.astype(x.dtype), self.eps)


class Leaves(nn.Module):
    """Named parameter arrays under this module's name (the layout moe.py's functions read)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    param_dtype: jnp.dtype = jnp.float32
    init: str = "normal"  # "normal" (N(0, 0.02)) or "zeros"

    @nn.compact
    def __call__(self) -> dict:
        init = _init if self.init == "normal" else nn.initializers.zeros
        return {name: self.param(name, init, shape, self.param_dtype) for name, shape in self.shapes}


class MoEFeedForward(nn.Module):
    """A MoE feed-forward (localleap_jax.moe): the router's gate, its expert bias, the routed experts and the shared
    ones, under the names moe.py reads; the routed experts split over a mesh's "expert" axis when there is one."""

    arch: MoELayers
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, h):
        a, D = self.arch, h.shape[-1]
        E, F, S = a.moe.router.num_experts, a.expert_hidden, a.shared_hidden
        dt = self.param_dtype
        params = {"gate": Leaves((("kernel", (D, E)),), dt, name="gate")(),
                  "experts": Leaves((("gate_proj", (E, D, F)), ("up_proj", (E, D, F)), ("down_proj", (E, F, D))), dt,
                                    name="experts")()}
        if a.expert_bias:
            params["expert_bias"] = self.param("expert_bias", nn.initializers.zeros, (E,), dt)
        if S:
            params["shared"] = {n: Leaves((("kernel", shape),), dt, name=f"shared_{n}")()
                                for n, shape in (("gate_proj", (D, S)), ("up_proj", (D, S)), ("down_proj", (S, D)))}
        return moe_layer(a.moe, params, h, mesh=expert_mesh())


class Block(nn.Module):
    """One Llama-style block (LLaDA, or Dream with q/k/v biases). Returns (x, (k, v)) so the layer
    scan can stack K/V. `moe`: its feed-forward is a mixture of experts (config.arch, a MoELayers)."""

    config: ModelConfig
    param_dtype: jnp.dtype = jnp.float32
    moe: bool = False

    @nn.compact
    def __call__(self, x, positions, mask, write, layer_cache):
        c = self.config
        dense = functools.partial(nn.Dense, use_bias=False, kernel_init=_init,
                                  param_dtype=self.param_dtype, dtype=x.dtype)
        qkv = functools.partial(dense, use_bias=c.qkv_bias)
        B, T, _ = x.shape
        h = RMSNorm(c.rms_norm_eps, param_dtype=self.param_dtype, name="attn_norm")(x)
        q = qkv(c.n_heads * c.head_dim, name="q_proj")(h).reshape(B, T, c.n_heads, c.head_dim)
        k = qkv(c.n_kv_heads * c.head_dim, name="k_proj")(h).reshape(B, T, c.n_kv_heads, c.head_dim)
        v = qkv(c.n_kv_heads * c.head_dim, name="v_proj")(h).reshape(B, T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:  # Qwen3: each head of q and k normalised before RoPE
            q = RMSNorm(c.rms_norm_eps, param_dtype=self.param_dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, param_dtype=self.param_dtype, name="k_norm")(k)
        q, k = rope(q, positions, c.rope_theta, c.rotary_dim), rope(k, positions, c.rope_theta, c.rotary_dim)
        if layer_cache:  # queries are a window of the canvas; the other keys come from the cache
            k_all, v_all = (_write_window(cached, new, write) for cached, new in zip(layer_cache, (k, v)))
        else:
            k_all, v_all = k, v
        o = attention(q, k_all, v_all, mask).reshape(B, T, c.n_heads * c.head_dim)
        x = x + dense(c.d_model, name="attn_out")(o)
        h = RMSNorm(c.rms_norm_eps, param_dtype=self.param_dtype, name="ff_norm")(x)
        if self.moe:
            return x + MoEFeedForward(c.arch, self.param_dtype, name="moe")(h), (k, v)
        gated = nn.silu(dense(c.mlp_hidden_size, name="ff_proj")(h)) * dense(c.mlp_hidden_size, name="up_proj")(h)
        x = x + dense(c.d_model, name="ff_out")(gated)
        return x, (k, v)


def segments(config: ModelConfig) -> tuple[tuple[str, bool, int, int], ...]:
    """The layers as runs of one kind, each scanned as one stack: (tree name, MoE or not, first layer, layers).
    Without MoE one run, "blocks"; a MoE model's runs are "blocks" / "moe_blocks" (a second run of a kind gets
    "_<k>"): LLaDA2 (one dense layer, then MoE) is "blocks" [1] and "moe_blocks" [N - 1]."""
    kinds = config.arch.layers if isinstance(config.arch, MoELayers) else (False,) * config.n_layers
    runs, seen = [], {}
    for i, kind in enumerate(kinds):
        if runs and runs[-1][1] == kind:
            name, _, first, count = runs[-1]
            runs[-1] = (name, kind, first, count + 1)
            continue
        base = "moe_blocks" if kind else "blocks"
        seen[base] = seen.get(base, 0) + 1
        runs.append((base if seen[base] == 1 else f"{base}_{seen[base] - 1}", kind, i, 1))
    return tuple(runs)


def layer_slot(config: ModelConfig, layer: int) -> tuple[str, int]:
    """Where layer `layer` sits in the tree: (its run's name, its index in that stack)."""
    for name, _, first, count in segments(config):
        if first <= layer < first + count:
            return name, layer - first
    raise IndexError(f"layer {layer} of a {config.n_layers}-layer model")


def _write_window(cache: Float[Array, "B L K H"], new: Float[Array, "B Q K H"], write: CacheWrite):
    """The cache with this step's K/V written over the window positions marked fresh."""
    def one_row(cache_row, new_row, start, fresh):
        old = jax.lax.dynamic_slice_in_dim(cache_row, start, new_row.shape[0], axis=0)
        merged = jnp.where(fresh[:, None, None], new_row.astype(cache_row.dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(cache_row, merged, start, axis=0)
    return jax.vmap(one_row)(cache, new, write.start, write.fresh)


class LMHead(nn.Module):
    """Untied output projection; accumulates and returns fp32 logits."""

    vocab: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, h):
        kernel = self.param("kernel", _init, (h.shape[-1], self.vocab), self.param_dtype)
        return jnp.einsum("...d,dv->...v", h, kernel.astype(h.dtype), preferred_element_type=jnp.float32)


class DiffusionLM(nn.Module):
    """Embedding, the scanned blocks, final norm and LM head; the same module for every family."""

    config: ModelConfig
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.config
        self.wte = nn.Embed(c.embedding_size, c.d_model, embedding_init=_init, param_dtype=self.param_dtype)
        self.runs = segments(c)
        self.stacks = [nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                               in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0), length=count)(
                           c, self.param_dtype, moe, name=name)
                       for name, moe, _, count in self.runs]
        self.ln_f = RMSNorm(c.rms_norm_eps, param_dtype=self.param_dtype)
        if not c.tie_word_embeddings:
            self.ff_out = LMHead(c.embedding_size, param_dtype=self.param_dtype)

    def __call__(self, tokens, positions, key_mask):
        h, _ = self.trunk(tokens, positions, key_mask)
        return self.head(h)

    def trunk(self, tokens, positions, key_mask, write=(), cache=(), mask=None, soft=None):
        x = self.wte(tokens)
        if soft is not None:  # an input embedding from the decode loop, added to the tokens' (iteration smoothing)
            x = x + soft.astype(x.dtype)
        if mask is None:
            mask = attention_mask(positions, key_mask, self.config.block_size)
        if len(self.stacks) == 1:
            return self.stacks[0](x, positions, mask, write, cache)
        ks, vs = [], []
        for stack, (_, _, first, count) in zip(self.stacks, self.runs):  # each run of layers reads its cache slice
            layer_cache = tuple(c[first:first + count] for c in cache) if cache else ()
            x, (k, v) = stack(x, positions, mask, write, layer_cache)
            ks.append(k)
            vs.append(v)
        return x, (jnp.concatenate(ks), jnp.concatenate(vs))

    def head(self, h):
        h = self.ln_f(h)
        if self.config.tie_word_embeddings:  # the embedding matrix is the head (fp32 accumulation as LMHead)
            return jnp.einsum("...d,vd->...v", h, self.wte.embedding.astype(h.dtype),
                              preferred_element_type=jnp.float32)
        return self.ff_out(h)


# ---------------------------------------------------------------- pure boundary functions


def _module(params: Params, config: ModelConfig) -> DiffusionLM:
    return DiffusionLM(config, param_dtype=params["wte"]["embedding"].dtype)


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (N(0, 0.02) matrices, zero biases, unit norms), for training and tests."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    mask = jnp.ones((1, 2), bool)
    variables = jax.jit(DiffusionLM(config, param_dtype=jnp.dtype(dtype)).init)(rng, tokens, positions_from_mask(mask), mask)
    return variables["params"]


@functools.partial(jax.jit, static_argnames=("config",))
def trunk(params: Params, tokens: Int[Array, "B L"], positions: Int[Array, "B L"], key_mask: Bool[Array, "B L"],
          config: ModelConfig, soft: Float[Array, "B L D"] | None = None) -> tuple[Float[Array, "B L D"], KVCache]:
    """Hidden states before the final norm, and every layer's K/V (for a KV cache). `soft`: added to the token
    embeddings (an input embedding from the decode loop; None: none)."""
    h, (k, v) = _module(params, config).apply({"params": params}, tokens, positions, key_mask, soft=soft,
                                              method=DiffusionLM.trunk)
    return h, KVCache(k, v)


@functools.partial(jax.jit, static_argnames=("config",))
def trunk_masked(params: Params, tokens: Int[Array, "B L"], positions: Int[Array, "B L"],
                 mask: Bool[Array, "B L L"], config: ModelConfig) -> Float[Array, "B L D"]:
    """Hidden states under an explicit attention mask (mask[b, q, k]: query q sees key k), for training
    objectives whose sequences are not one canvas (block diffusion's clean and noisy copies side by side)."""
    h, _ = _module(params, config).apply({"params": params}, tokens, positions, None, mask=mask,
                                         method=DiffusionLM.trunk)
    return h


@functools.partial(jax.jit, static_argnames=("config",))
def trunk_cached(params: Params, tokens: Int[Array, "B Q"], positions: Int[Array, "B Q"],
                 key_mask: Bool[Array, "B L"], cache: KVCache, write: CacheWrite,
                 config: ModelConfig, soft: Float[Array, "B Q D"] | None = None) -> Float[Array, "B Q D"]:
    """Hidden states for a window of Q canvas positions whose queries attend over all L keys:
    this step's K/V where `write.fresh`, the cache's everywhere else."""
    h, _ = _module(params, config).apply({"params": params}, tokens, positions, key_mask, write,
                                         (cache.k, cache.v), soft=soft, method=DiffusionLM.trunk)
    return h


@functools.partial(jax.jit, static_argnames=("config",))
def trunk_stored(params: Params, tokens: Int[Array, "B Q"], positions: Int[Array, "B Q"],
                 key_mask: Bool[Array, "B L"], cache: KVCache, write: CacheWrite,
                 config: ModelConfig, soft: Float[Array, "B Q D"] | None = None) -> tuple[Float[Array, "B Q D"], KVCache]:
    """`trunk_cached`, and the cache with the window's fresh K/V written into it (block diffusion keeps a
    finished block's K/V: they never change)."""
    h, (k, v) = _module(params, config).apply({"params": params}, tokens, positions, key_mask, write,
                                              (cache.k, cache.v), soft=soft, method=DiffusionLM.trunk)
    store = jax.vmap(_write_window, in_axes=(0, 0, None))  # over layers
    return h, KVCache(store(cache.k, k, write), store(cache.v, v, write))


@functools.partial(jax.jit, static_argnames=("config",))
def head(params: Params, hidden: Float[Array, "... D"], config: ModelConfig) -> Float[Array, "... V"]:
    """Final RMSNorm + LM head, in fp32 logits, for only the positions passed in."""
    return _module(params, config).apply({"params": params}, hidden, method=DiffusionLM.head)


@functools.partial(jax.jit, static_argnames=("config",))
def forward(params: Params, tokens: Int[Array, "B L"], mask: Bool[Array, "B L"] | None,
            config: ModelConfig) -> Float[Array, "B L V"]:
    """Logits for every position, logit i scoring the token at i (for Dream: the head's output at i-1, see
    `shift_logits`); `mask` marks real (non-padding) tokens. Bidirectional, or block-causal for SDAR."""
    if mask is None:
        mask = jnp.ones(tokens.shape, bool)
    mask = mask.astype(bool)
    h, _ = trunk(params, tokens, positions_from_mask(mask), mask, config)
    logits = head(params, h, config)
    return shift_logits(logits, mask) if config.logits_shift else logits


def shift_logits(logits: Float[Array, "B L V"], mask: Bool[Array, "B L"]) -> Float[Array, "B L V"]:
    """Dream's one-position lag: position i takes the head's output at i-1.

    Dream's own code shifts whole rows (`cat([l[:, :1], l[:, :-1]], 1)`): the first position
    keeps its own logits. Here a position whose predecessor is padding also keeps its own, so a
    left-padded row gets exactly the logits of the same row unpadded. The two rules differ only
    at a row's first real token (and at padding), which no decoding step reads.
    """
    previous = jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
    previous_is_real = jnp.concatenate([jnp.zeros_like(mask[:, :1]), mask[:, :-1]], axis=1)
    return jnp.where(previous_is_real[..., None], previous, logits)
