"""The diffusion LM transformer (LLaDA, Dream, SDAR, LLaDA2, LLaDA-MoE, Fast-dLLM v2): one layer as pure functions of
its parameters, the Linen modules that declare and train them, and the boundary functions the rest calls.

A Llama block: RMSNorm -> attention with RoPE -> residual, RMSNorm -> SwiGLU (or a mixture of experts) -> residual;
final RMSNorm and an LM head. The families differ only in configuration: Dream (a Qwen2.5 block) adds biases to the
q/k/v projections and uses its own norm eps and RoPE theta, and its logits lag by one position
(`ModelConfig.logits_shift`), which `forward` applies and `trunk`/`head` leave to the caller. SDAR (a Qwen3
block) normalises each head of q and k before RoPE, may tie its head to the embedding, and attends
block-causally (`ModelConfig.block_size`): a query sees the keys of its own block and of earlier ones, on
each row's grid from its first real token. LLaDA and Dream attend bidirectionally.

Two layouts of the same parameters:
  stacked    {"wte", "blocks" (+ "moe_blocks", ...: `segments`), "ln_f", "ff_out"}: each run of layers' leaves
             stacked [n_layers, ...]. What `init_params` makes, training updates (`nn.scan` over the stack, so
             compile time does not grow with depth) and checkpoints store.
  decoding   {"wte", "layers": (layer 0, layer 1, ...), "ln_f", "ff_out"}: one array per layer and matrix, split
             once (`decoding_params`; `ll.load` does it). Decoding runs the layers unrolled over these, so a pass
             reads each weight where it lies: cutting a layer out of a stack inside the loop (what a scan does)
             copies every weight once per pass, which at small batch costs more than the matmuls (issue #44).
The boundary functions take either layout; the math is the same functions (`attention_inputs`,
`attention_output`, `feed_forward`) either way.

Precision: weights and matmuls in the parameter dtype (bf16 by default); RMSNorm, RoPE and the attention softmax
in fp32; logits returned in fp32.

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
`soft` (trunk, trunk_cached, trunk_stored): an addition to the token embeddings of the positions run (a rule that
feeds the model a soft input: iteration smoothing).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from localleap_jax import attention as fused
from localleap_jax.config import ModelConfig
from localleap_jax.moe import MoELayers, expert_mesh, moe_layer

Params = dict  # the parameter tree, stacked or decoding layout (module docstring)


class KVCache(NamedTuple):
    """Keys and values of every layer at every canvas position (after RoPE): one array per layer, so a pass reads
    and writes each layer's in place; heads first ([B, K, L, H]: each head's keys contiguous, the layout the
    attention products read, so a cached pass never transposes the cache)."""

    k: tuple[Float[Array, "B K L H"], ...]
    v: tuple[Float[Array, "B K L H"], ...]


def heads_first(a: Float[Array, "B L K H"]) -> Float[Array, "B K L H"]:
    """K or V as a projection makes them ([B, L, K, H]) in the cache's layout."""
    return a.transpose(0, 2, 1, 3)


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


def attention(q: Float[Array, "B T N H"], k: Float[Array, "B S K H"], v: Float[Array, "B S K H"],
              mask: Bool[Array, "B #T S"]) -> Float[Array, "B T N H"]:
    """Attention where mask[b, t, s] says query t may see key s (a [B, S] key mask: every query alike;
    softmax in fp32).

    A key-padding mask (every query alike: a whole-canvas pass of a bidirectional model) takes the platform's fused
    kernel where there is one (attention.py: cuDNN on a GPU, splash on a TPU), which never writes the [N, T, S]
    scores: as each row's real keys are its last lengths[b] (left padding), or XLA's path when the mask is not of
    that form (checked on the device, one branch taken). Any other mask (block-causal, a probe copy): XLA's path."""
    if mask.ndim == 2:
        mask = mask[:, None, :]
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    impl = fused.implementation_for(q.dtype, H, N, K, T, S, padding_only=mask.shape[1] == 1)
    if impl == "xla":
        return fused.xla_attention(q, k, v, mask)
    keys = mask[:, 0, :]
    lengths = jnp.sum(keys, axis=1, dtype=jnp.int32)
    left_padded = jnp.all(keys == (jnp.arange(S)[None, :] >= (S - lengths)[:, None])) & jnp.all(lengths > 0)
    return jax.lax.cond(left_padded,
                        lambda: fused.attention(q, k, v, kv_lengths=lengths, implementation=impl),
                        lambda: fused.xla_attention(q, k, v, mask))


def attention_implementation(dtype_name: str, head_dim: int, heads: int = 1, kv_heads: int = 1,
                             length: int = 1024) -> str:
    """The kernel a whole-canvas pass of this shape takes on this process's backend ("xla", "cudnn", "splash")."""
    return fused.implementation_for(jnp.dtype(dtype_name), head_dim, heads, kv_heads, length, length, True)


def attention_two_parts(q: Float[Array, "B T N H"], parts: tuple[tuple[Array, Array, Array], ...]
                        ) -> Float[Array, "B T N H"]:
    """Attention over keys held in several arrays, one softmax over all of them: `parts` are (k [B, K, S, H],
    v [B, K, S, H], mask [B, #T, S]) each, heads first (the cache's layout). A cached pass attends over the cache and
    its own window this way, so neither is copied into the other (the arithmetic of `jax.nn.dot_product_attention`'s
    XLA path)."""
    B, T, N, H = q.shape
    K = parts[0][0].shape[1]
    qg = q.reshape(B, T, K, N // K, H)
    scale = jnp.float32(1.0 / np.sqrt(H))
    big_negative = jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max))  # as jax.nn.dot_product_attention masks
    logits = []
    for k, _, mask in parts:
        s = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        logits.append(jnp.where(mask[:, None, None, :, :], s, big_negative))
    probs = jax.nn.softmax(jnp.concatenate(logits, axis=-1), axis=-1).astype(parts[0][1].dtype)
    out, at = None, 0
    for k, v, _ in parts:
        width = k.shape[2]
        o = jnp.einsum("bkgts,bksh->btkgh", probs[..., at:at + width], v)
        out = o if out is None else out + o
        at += width
    return out.reshape(B, T, N, H)


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


# ---------------------------------------------------------------- one layer, as pure functions of its parameters
# A layer's parameters are a dict in Linen's naming: attn_norm/scale, q_proj, k_proj, v_proj (kernel [D, out],
# bias with qkv_bias), q_norm/k_norm (qk_norm), attn_out, ff_norm, and ff_proj/up_proj/ff_out (a dense layer) or
# moe (a mixture of experts: gate, experts, expert_bias, shared_gate_proj/shared_up_proj/shared_down_proj).


def linear(p: dict, x: Float[Array, "... I"]) -> Float[Array, "... O"]:
    """x @ kernel (+ bias), in the input's dtype: nn.Dense's arithmetic."""
    kernel = p["kernel"].astype(x.dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    return y + p["bias"].astype(x.dtype) if "bias" in p else y


def norm(p: dict, x: Float[Array, "... D"], eps: float) -> Float[Array, "... D"]:
    return rms_norm(x, p["scale"].astype(x.dtype), eps)


def attention_inputs(p: dict, x: Float[Array, "B T D"], positions: Int[Array, "B T"], c: ModelConfig
                     ) -> tuple[Float[Array, "B T N H"], Float[Array, "B T K H"], Float[Array, "B T K H"]]:
    """The layer's queries, keys and values of x (after its norm, q/k norms and RoPE)."""
    B, T, _ = x.shape
    h = norm(p["attn_norm"], x, c.rms_norm_eps)
    q = linear(p["q_proj"], h).reshape(B, T, c.n_heads, c.head_dim)
    k = linear(p["k_proj"], h).reshape(B, T, c.n_kv_heads, c.head_dim)
    v = linear(p["v_proj"], h).reshape(B, T, c.n_kv_heads, c.head_dim)
    if c.qk_norm:  # Qwen3: each head of q and k normalised before RoPE
        q, k = norm(p["q_norm"], q, c.rms_norm_eps), norm(p["k_norm"], k, c.rms_norm_eps)
    return rope(q, positions, c.rope_theta, c.rotary_dim), rope(k, positions, c.rope_theta, c.rotary_dim), v


def attention_output(p: dict, o: Float[Array, "B T N H"]) -> Float[Array, "B T D"]:
    """The attention sublayer's output (before the residual): the heads through attn_out."""
    B, T, N, H = o.shape
    return linear(p["attn_out"], o.reshape(B, T, N * H))


def feed_forward(p: dict, x: Float[Array, "B T D"], c: ModelConfig, moe: bool) -> Float[Array, "B T D"]:
    """The feed-forward sublayer's output (before the residual): its norm, then SwiGLU or the mixture of experts."""
    h = norm(p["ff_norm"], x, c.rms_norm_eps)
    if moe:
        return moe_layer(c.arch.moe, moe_params(p["moe"]), h, mesh=expert_mesh())
    return linear(p["ff_out"], nn.silu(linear(p["ff_proj"], h)) * linear(p["up_proj"], h))


def moe_params(p: dict) -> dict:
    """A MoE layer's tree (Linen's names) as moe.py reads it."""
    out = {"gate": p["gate"], "experts": p["experts"]}
    if "expert_bias" in p:
        out["expert_bias"] = p["expert_bias"]
    shared = {n: p[f"shared_{n}"] for n in ("gate_proj", "up_proj", "down_proj") if f"shared_{n}" in p}
    if shared:
        out["shared"] = shared
    return out


def layer_kinds(config: ModelConfig) -> tuple[bool, ...]:
    """Per layer: True where its feed-forward is a mixture of experts."""
    return config.arch.layers if isinstance(config.arch, MoELayers) else (False,) * config.n_layers


# ---------------------------------------------------------------- Linen modules (init and training: stacked)

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


class LinearParams(nn.Module):
    """A projection's parameters as nn.Dense declares them: kernel [in, out] ~ N(0, 0.02), then a zero bias."""

    shape: tuple[int, int]
    bias: bool = False
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        p = {"kernel": self.param("kernel", _init, self.shape, self.param_dtype)}
        if self.bias:
            p["bias"] = self.param("bias", nn.initializers.zeros, (self.shape[1],), self.param_dtype)
        return p


class ScaleParams(nn.Module):
    """A norm's scale as RMSNorm declares it: ones."""

    width: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        return {"scale": self.param("scale", nn.initializers.ones, (self.width,), self.param_dtype)}


class MoEParams(nn.Module):
    """A MoE feed-forward's parameters (localleap_jax.moe): the router's gate, its expert bias, the routed experts and
    the shared ones, under the names `moe_params` maps to moe.py's."""

    arch: MoELayers
    d_model: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        a, D, dt = self.arch, self.d_model, self.param_dtype
        E, F, S = a.moe.router.num_experts, a.expert_hidden, a.shared_hidden
        p = {"gate": Leaves((("kernel", (D, E)),), dt, name="gate")(),
             "experts": Leaves((("gate_proj", (E, D, F)), ("up_proj", (E, D, F)), ("down_proj", (E, F, D))), dt,
                               name="experts")()}
        if a.expert_bias:
            p["expert_bias"] = self.param("expert_bias", nn.initializers.zeros, (E,), dt)
        for n, shape in ((("gate_proj", (D, S)), ("up_proj", (D, S)), ("down_proj", (S, D))) if S else ()):
            p[f"shared_{n}"] = Leaves((("kernel", shape),), dt, name=f"shared_{n}")()
        return p


class Block(nn.Module):
    """One layer under `nn.scan` (training and the stacked layout): declares its parameters in its own scope (the
    names checkpoints store), then runs the pure layer functions. Returns (x, (k, v)) so the scan stacks K/V.
    `moe`: its feed-forward is a mixture of experts (config.arch, a MoELayers)."""

    config: ModelConfig
    param_dtype: jnp.dtype = jnp.float32
    moe: bool = False

    @nn.compact
    def __call__(self, x, positions, mask):
        p = self.layer_params()
        q, k, v = attention_inputs(p, x, positions, self.config)
        x = x + attention_output(p, attention(q, k, v, mask))
        return x + feed_forward(p, x, self.config, self.moe), (k, v)

    def layer_params(self) -> dict:
        c, dt = self.config, self.param_dtype
        D, q, kv = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        p = {"attn_norm": ScaleParams(D, dt, name="attn_norm")(),
             "q_proj": LinearParams((D, q), c.qkv_bias, dt, name="q_proj")(),
             "k_proj": LinearParams((D, kv), c.qkv_bias, dt, name="k_proj")(),
             "v_proj": LinearParams((D, kv), c.qkv_bias, dt, name="v_proj")()}
        if c.qk_norm:
            p["q_norm"] = ScaleParams(c.head_dim, dt, name="q_norm")()
            p["k_norm"] = ScaleParams(c.head_dim, dt, name="k_norm")()
        p["attn_out"] = LinearParams((q, D), False, dt, name="attn_out")()
        p["ff_norm"] = ScaleParams(D, dt, name="ff_norm")()
        if self.moe:
            p["moe"] = MoEParams(c.arch, D, dt, name="moe")()
        else:
            F = c.mlp_hidden_size
            p["ff_proj"] = LinearParams((D, F), False, dt, name="ff_proj")()
            p["up_proj"] = LinearParams((D, F), False, dt, name="up_proj")()
            p["ff_out"] = LinearParams((F, D), False, dt, name="ff_out")()
        return p


def segments(config: ModelConfig) -> tuple[tuple[str, bool, int, int], ...]:
    """The layers as runs of one kind, each scanned as one stack: (tree name, MoE or not, first layer, layers).
    Without MoE one run, "blocks"; a MoE model's runs are "blocks" / "moe_blocks" (a second run of a kind gets
    "_<k>"): LLaDA2 (one dense layer, then MoE) is "blocks" [1] and "moe_blocks" [N - 1]."""
    runs, seen = [], {}
    for i, kind in enumerate(layer_kinds(config)):
        if runs and runs[-1][1] == kind:
            name, _, first, count = runs[-1]
            runs[-1] = (name, kind, first, count + 1)
            continue
        base = "moe_blocks" if kind else "blocks"
        seen[base] = seen.get(base, 0) + 1
        runs.append((base if seen[base] == 1 else f"{base}_{seen[base] - 1}", kind, i, 1))
    return tuple(runs)


def layer_slot(config: ModelConfig, layer: int) -> tuple[str, int]:
    """Where layer `layer` sits in the stacked tree: (its run's name, its index in that stack)."""
    for name, _, first, count in segments(config):
        if first <= layer < first + count:
            return name, layer - first
    raise IndexError(f"layer {layer} of a {config.n_layers}-layer model")


def _write_window(cache: Float[Array, "B K L H"], new: Float[Array, "B K Q H"], write: CacheWrite):
    """The cache with this step's K/V written over the window positions marked fresh (in place where the cache is
    not read again)."""
    def one_row(cache_row, new_row, start, fresh):
        old = jax.lax.dynamic_slice_in_dim(cache_row, start, new_row.shape[1], axis=1)
        merged = jnp.where(fresh[None, :, None], new_row.astype(cache_row.dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(cache_row, merged, start, axis=1)
    return jax.vmap(one_row)(cache, new, write.start, write.fresh)


def _window_keys(cache_k: Float[Array, "B K L H"], write: CacheWrite) -> Bool[Array, "B L"]:
    """The cache positions a window's fresh K/V replace."""
    L, Q = cache_k.shape[2], write.fresh.shape[1]
    rel = jnp.arange(L)[None, :] - write.start[:, None]
    inside = (rel >= 0) & (rel < Q)
    return inside & jnp.take_along_axis(write.fresh, jnp.clip(rel, 0, Q - 1), axis=1)


class LMHead(nn.Module):
    """Untied output projection; accumulates and returns fp32 logits."""

    vocab: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, h):
        kernel = self.param("kernel", _init, (h.shape[-1], self.vocab), self.param_dtype)
        return jnp.einsum("...d,dv->...v", h, kernel.astype(h.dtype), preferred_element_type=jnp.float32)


class DiffusionLM(nn.Module):
    """Embedding, the scanned blocks, final norm and LM head (the stacked layout); the same module for every
    family."""

    config: ModelConfig
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.config
        self.wte = nn.Embed(c.embedding_size, c.d_model, embedding_init=_init, param_dtype=self.param_dtype)
        self.runs = segments(c)
        self.stacks = [nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                               in_axes=(nn.broadcast, nn.broadcast), length=count)(
                           c, self.param_dtype, moe, name=name)
                       for name, moe, _, count in self.runs]
        self.ln_f = RMSNorm(c.rms_norm_eps, param_dtype=self.param_dtype)
        if not c.tie_word_embeddings:
            self.ff_out = LMHead(c.embedding_size, param_dtype=self.param_dtype)

    def __call__(self, tokens, positions, key_mask):
        h, _ = self.trunk(tokens, positions, key_mask)
        return self.head(h)

    def trunk(self, tokens, positions, key_mask, mask=None, soft=None):
        x = self.wte(tokens)
        if soft is not None:  # an input embedding from the decode loop, added to the tokens' (iteration smoothing)
            x = x + soft.astype(x.dtype)
        if mask is None:
            mask = attention_mask(positions, key_mask, self.config.block_size)
        ks, vs = [], []
        for stack in self.stacks:
            x, (k, v) = stack(x, positions, mask)
            ks.extend(k)
            vs.extend(v)
        return x, (tuple(ks), tuple(vs))

    def head(self, h):
        h = self.ln_f(h)
        if self.config.tie_word_embeddings:  # the embedding matrix is the head (fp32 accumulation as LMHead)
            return jnp.einsum("...d,vd->...v", h, self.wte.embedding.astype(h.dtype),
                              preferred_element_type=jnp.float32)
        return self.ff_out(h)


# ---------------------------------------------------------------- the two layouts


def is_decoding_layout(params: Params) -> bool:
    return "layers" in params


def decoding_params(params: Params, config: ModelConfig, *, free: bool = False) -> Params:
    """The decoding layout (module docstring) of a stacked tree: one array per layer and matrix, split once (a tree
    already in it is returned as it is). `free`: delete each stacked leaf once it is split (`ll.load`: the model's
    bytes are then held once, plus one leaf, never twice)."""
    if is_decoding_layout(params):
        return params
    layers: list = [None] * config.n_layers
    for name, _, first, count in segments(config):
        def split(leaf):
            parts = tuple(leaf[j] for j in range(count))
            if free and isinstance(leaf, jax.Array):
                leaf.delete()
            return parts
        per_leaf = jax.tree.map(split, params[name])
        for j in range(count):
            layers[first + j] = jax.tree.map(lambda parts: parts[j], per_leaf, is_leaf=lambda a: isinstance(a, tuple))
    rest = {k: v for k, v in params.items() if k not in {name for name, *_ in segments(config)}}
    return {**rest, "layers": tuple(layers)}


def stacked_params(params: Params, config: ModelConfig) -> Params:
    """The stacked layout (what checkpoints store and training updates) of a tree in either layout."""
    if not is_decoding_layout(params):
        return params
    layers = params["layers"]
    out = {k: v for k, v in params.items() if k != "layers"}
    for name, _, first, count in segments(config):
        out[name] = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers[first:first + count])
    return out


def _embed(params: Params, tokens: Int[Array, "B T"], soft: Float[Array, "B T D"] | None) -> Float[Array, "B T D"]:
    x = jnp.take(params["wte"]["embedding"], tokens, axis=0)
    return x if soft is None else x + soft.astype(x.dtype)


AttendFn = Callable[[int, Array, Array, Array], tuple[Array, tuple[Array, Array]]]


def _unrolled(params: Params, x: Float[Array, "B T D"], positions: Int[Array, "B T"], config: ModelConfig,
              attend: AttendFn) -> tuple[Float[Array, "B T D"], tuple[tuple, tuple]]:
    """The layers over the decoding layout, unrolled: each reads its own weights in place. `attend(i, q, k, v)`
    -> (attention output, the layer's (k, v) to return) says where layer i's keys come from."""
    ks, vs = [], []
    for i, (p, moe) in enumerate(zip(params["layers"], layer_kinds(config))):
        q, k, v = attention_inputs(p, x, positions, config)
        o, (k_out, v_out) = attend(i, q, k, v)
        x = x + attention_output(p, o)
        x = x + feed_forward(p, x, config, moe)
        ks.append(k_out)
        vs.append(v_out)
    return x, (tuple(ks), tuple(vs))


# ---------------------------------------------------------------- pure boundary functions


def _module(params: Params, config: ModelConfig) -> DiffusionLM:
    return DiffusionLM(config, param_dtype=params["wte"]["embedding"].dtype)


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters in the stacked layout (N(0, 0.02) matrices, zero biases, unit norms), for training and
    tests."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    mask = jnp.ones((1, 2), bool)
    module = DiffusionLM(config, param_dtype=jnp.dtype(dtype))
    variables = jax.jit(module.init)(rng, tokens, positions_from_mask(mask), mask)
    return variables["params"]


@functools.partial(jax.jit, static_argnames=("config",))
def trunk(params: Params, tokens: Int[Array, "B L"], positions: Int[Array, "B L"], key_mask: Bool[Array, "B L"],
          config: ModelConfig, soft: Float[Array, "B L D"] | None = None) -> tuple[Float[Array, "B L D"], KVCache]:
    """Hidden states before the final norm, and every layer's K/V (for a KV cache)."""
    if not is_decoding_layout(params):
        h, (k, v) = _module(params, config).apply({"params": params}, tokens, positions, key_mask, soft=soft,
                                                  method=DiffusionLM.trunk)
        return h, KVCache(tuple(map(heads_first, k)), tuple(map(heads_first, v)))
    mask = attention_mask(positions, key_mask, config.block_size)
    h, (k, v) = _unrolled(params, _embed(params, tokens, soft), positions, config,
                          lambda i, q, k, v: (attention(q, k, v, mask), (heads_first(k), heads_first(v))))
    return h, KVCache(k, v)


@functools.partial(jax.jit, static_argnames=("config",))
def trunk_masked(params: Params, tokens: Int[Array, "B L"], positions: Int[Array, "B L"],
                 mask: Bool[Array, "B L L"], config: ModelConfig) -> Float[Array, "B L D"]:
    """Hidden states under an explicit attention mask (mask[b, q, k]: query q sees key k), for training
    objectives whose sequences are not one canvas (block diffusion's clean and noisy copies side by side)."""
    if not is_decoding_layout(params):
        h, _ = _module(params, config).apply({"params": params}, tokens, positions, None, mask=mask,
                                             method=DiffusionLM.trunk)
        return h
    h, _ = _unrolled(params, _embed(params, tokens, None), positions, config,
                     lambda i, q, k, v: (attention(q, k, v, mask), (k, v)))
    return h


@functools.partial(jax.jit, static_argnames=("config",))
def trunk_cached(params: Params, tokens: Int[Array, "B Q"], positions: Int[Array, "B Q"],
                 key_mask: Bool[Array, "B L"], cache: KVCache, write: CacheWrite,
                 config: ModelConfig, soft: Float[Array, "B Q D"] | None = None) -> Float[Array, "B Q D"]:
    """Hidden states for a window of Q canvas positions whose queries attend over all L keys:
    this step's K/V where `write.fresh`, the cache's everywhere else (the cache itself is not written)."""
    params = decoding_params(params, config)
    seen = attention_mask(positions, key_mask, config.block_size)  # [B, #Q, L]
    replaced = _window_keys(cache.k[0], write)  # cache positions this window's fresh K/V stand for
    own = _own_window_mask(positions, write, key_mask, config.block_size)  # [B, Q, Q]: window key j seen by query i

    def attend(i, q, k, v):
        parts = ((cache.k[i], cache.v[i], seen & ~replaced[:, None, :]), (heads_first(k), heads_first(v), own))
        return attention_two_parts(q, parts), (k, v)

    h, _ = _unrolled(params, _embed(params, tokens, soft), positions, config, attend)
    return h


def _own_window_mask(positions: Int[Array, "B Q"], write: CacheWrite, key_mask: Bool[Array, "B L"],
                     block_size: int) -> Bool[Array, "B Q Q"]:
    """Which of the window's own fresh keys each of its queries sees (real ones; block-causal models: by block on
    the grid)."""
    Q = write.fresh.shape[1]
    real = jnp.take_along_axis(key_mask, jnp.clip(write.start[:, None] + jnp.arange(Q), 0, key_mask.shape[1] - 1),
                               axis=1)
    keys = (write.fresh & real)[:, None, :]
    if not block_size:
        return jnp.broadcast_to(keys, (keys.shape[0], Q, Q))
    return keys & ((positions // block_size)[:, None, :] <= (positions // block_size)[:, :, None])


@functools.partial(jax.jit, static_argnames=("config",))
def trunk_stored(params: Params, tokens: Int[Array, "B Q"], positions: Int[Array, "B Q"],
                 key_mask: Bool[Array, "B L"], cache: KVCache, write: CacheWrite,
                 config: ModelConfig, soft: Float[Array, "B Q D"] | None = None) -> tuple[Float[Array, "B Q D"], KVCache]:
    """`trunk_cached`, and the cache with the window's fresh K/V written into it, in place (block diffusion keeps a
    finished block's K/V: they never change)."""
    params = decoding_params(params, config)
    seen = attention_mask(positions, key_mask, config.block_size)

    def attend(i, q, k, v):
        k_all = _write_window(cache.k[i], heads_first(k), write)
        v_all = _write_window(cache.v[i], heads_first(v), write)
        return attention_two_parts(q, ((k_all, v_all, seen),)), (k_all, v_all)

    h, (k, v) = _unrolled(params, _embed(params, tokens, soft), positions, config, attend)
    return h, KVCache(k, v)


@functools.partial(jax.jit, static_argnames=("config",))
def head(params: Params, hidden: Float[Array, "... D"], config: ModelConfig) -> Float[Array, "... V"]:
    """Final RMSNorm + LM head, in fp32 logits, for only the positions passed in."""
    h = rms_norm(hidden, params["ln_f"]["scale"].astype(hidden.dtype), config.rms_norm_eps)
    if config.tie_word_embeddings:  # the embedding matrix is the head (fp32 accumulation as the untied one)
        return jnp.einsum("...d,vd->...v", h, params["wte"]["embedding"].astype(h.dtype),
                          preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", h, params["ff_out"]["kernel"].astype(h.dtype), preferred_element_type=jnp.float32)


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
