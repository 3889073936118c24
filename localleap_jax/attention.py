"""Attention for the model: one function that takes a fused kernel where the backend has one and the mask allows.

    out = attention(q, k, v, mask)                     # mask [B, #T, S]: query t sees key s (any pattern: XLA)
    out = attention(q, k, v, kv_lengths=lengths)       # every query sees each row's last lengths[b] keys

q [B, T, N, H], k and v [B, S, K, H] (K divides N: grouped-query heads), out [B, T, N, H] in q's dtype; the softmax
in fp32, scale 1/sqrt(H). `kv_lengths` is how a key-padding mask of left-padded rows is passed (the canvas' key mask:
padding, then the prompt and the generated region): with it a fused kernel can run.

Which implementation (`implementation_for`):
- "cudnn" on a GPU whose cuDNN accepts the call (a probe compiles the exact call once per dtype, head size and
  head counts; `PROBE_FAILURES` keeps why it did not): `jax.nn.dot_product_attention(..., implementation="cudnn")`.
  cuDNN's padding mask is a right-padding one (`key_value_seq_lengths`: keys [0, length)); attention does not
  depend on the keys' order, so the keys and values are reversed along S first (left padding becomes right
  padding; a copy of K/V, small beside the scores a fused kernel never writes).
- "splash" on a TPU (Pallas splash attention, jax.experimental.pallas.ops.tpu.splash_attention) when T and S are
  whole multiples of its 128-row blocks: key padding as segment ids (padding 0, real tokens 1), grouped heads as
  one multi-query kernel per key/value head.
- "xla" everywhere else, and for any other mask (block-causal, a probe copy): the reference the others are tested
  against, the einsum with an explicit [B, N, T, S] score array.
`LOCALLEAP_ATTENTION=xla|cudnn|splash` forces one. A program compiled ahead of time for another platform (a TPU
topology from a CPU host) picks for that platform: `with lowering_platform("tpu"): ...` (dist/aot.py does).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from typing import Iterator

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

IMPLEMENTATIONS = ("xla", "cudnn", "splash")
SPLASH_BLOCK = 128  # rows of q and of k/v per splash block (T and S must be whole multiples)
PROBE_FAILURES: dict[tuple, str] = {}  # (dtype, head_dim, heads, kv_heads) -> why cuDNN refused the probe

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("localleap_attention_platform", default=None)


@contextlib.contextmanager
def lowering_platform(platform: str | None) -> Iterator[None]:
    """Pick implementations for `platform` ("tpu", "gpu", "cpu") while tracing inside the block: for a program lowered
    ahead of time for devices this process does not run on. None: this process's default backend."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def platform() -> str:
    return _PLATFORM.get() or jax.default_backend()


def implementation_for(dtype, head_dim: int, heads: int, kv_heads: int, T: int, S: int, padding_only: bool) -> str:
    """The implementation `attention` takes for these shapes: "xla" unless the mask is key padding (or none) and the
    platform's fused kernel takes the call."""
    forced = os.environ.get("LOCALLEAP_ATTENTION")
    if forced in IMPLEMENTATIONS:
        return forced
    if not padding_only:
        return "xla"
    where = platform()
    if where == "gpu" and jnp.dtype(dtype).name in ("bfloat16", "float16"):
        return "cudnn" if cudnn_accepts(jnp.dtype(dtype).name, head_dim, heads, kv_heads) else "xla"
    if where == "tpu" and T % SPLASH_BLOCK == 0 and S % SPLASH_BLOCK == 0 and head_dim % 8 == 0:
        return "splash"
    return "xla"


@functools.lru_cache(maxsize=None)
def cudnn_accepts(dtype_name: str, head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether cuDNN compiles the call `attention` makes (lengths, no mask) for this dtype and head layout; the
    reason it does not is kept in PROBE_FAILURES (a 128-row probe: cuDNN's support depends on these, not on T)."""
    q = jax.ShapeDtypeStruct((1, 128, heads, head_dim), jnp.dtype(dtype_name))
    kv = jax.ShapeDtypeStruct((1, 128, kv_heads, head_dim), jnp.dtype(dtype_name))
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    probe = jax.jit(_cudnn)
    try:
        probe.lower(q, kv, kv, lengths).compile()
        return True
    except Exception as e:  # cuDNN missing, too old, or this dtype / head size / grouping unsupported
        PROBE_FAILURES[(dtype_name, head_dim, heads, kv_heads)] = f"{type(e).__name__}: {e}"[:500]
        return False


def attention(q: Float[Array, "B T N H"], k: Float[Array, "B S K H"], v: Float[Array, "B S K H"],
              mask: Bool[Array, "B #T S"] | None = None, *, kv_lengths: Int[Array, "B"] | None = None,
              implementation: str | None = None) -> Float[Array, "B T N H"]:
    """Softmax attention (fp32 softmax, scale 1/sqrt(H)): `mask[b, t, s]` says query t may see key s ([B, S]: every
    query alike), or `kv_lengths[b]`: row b's real keys are its last kv_lengths[b] (left padding); neither: all.
    `implementation` forces one of IMPLEMENTATIONS (the default picks: module docstring)."""
    if mask is not None and kv_lengths is not None:
        raise ValueError("pass a mask or kv_lengths, not both")
    if mask is not None and mask.ndim == 2:
        mask = mask[:, None, :]
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    impl = implementation or implementation_for(q.dtype, H, N, K, T, S, mask is None)
    if impl == "xla" or (mask is not None):
        if kv_lengths is not None:
            mask = (jnp.arange(S)[None, :] >= (S - kv_lengths)[:, None])[:, None, :]
        return xla_attention(q, k, v, mask)
    if kv_lengths is None:
        kv_lengths = jnp.full((B,), S, jnp.int32)
    if impl == "cudnn":
        return _cudnn(q, k, v, kv_lengths)
    if impl == "splash":
        return splash_attention(q, k, v, kv_lengths)
    raise ValueError(f"attention implementation {impl!r}: expected one of {', '.join(IMPLEMENTATIONS)}")


def xla_attention(q, k, v, mask: Bool[Array, "B #T S"] | None) -> Float[Array, "B T N H"]:
    """The reference: jax.nn.dot_product_attention's XLA path (scores [B, N, T, S] in fp32, masked, softmax)."""
    return jax.nn.dot_product_attention(q, k, v, mask=None if mask is None else mask[:, None],
                                        implementation="xla")


def _cudnn(q, k, v, kv_lengths, implementation: str = "cudnn"):
    """cuDNN's fused attention over keys reversed along S, so that each row's real keys are its first
    kv_lengths[b] (cuDNN's padding mask); `implementation="xla"` runs the same call on XLA's path (tests)."""
    flip = lambda a: jnp.flip(a, axis=1)  # noqa: E731
    return jax.nn.dot_product_attention(q, flip(k), flip(v), key_value_seq_lengths=kv_lengths.astype(jnp.int32),
                                        implementation=implementation)


def splash_attention(q, k, v, kv_lengths, *, interpret: bool = False) -> Float[Array, "B T N H"]:
    """Pallas splash attention (TPU): one multi-query kernel per key/value head, vmapped over the batch; key padding
    as segment ids. `interpret=True` runs the kernel's Pallas interpreter (any backend: tests)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    group = N // K
    blocks = splash.BlockSizes(block_q=min(SPLASH_BLOCK, T), block_kv=min(SPLASH_BLOCK, S),
                               block_kv_compute=min(SPLASH_BLOCK, S))
    full = masks.MultiHeadMask([masks.FullMask((T, S)) for _ in range(group)])
    kernel = splash.make_splash_mqa(full, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)
    scale = 1.0 / math.sqrt(H)
    # [B, K, group, T, H] queries (scaled in fp32, as XLA's path scales the scores), [B, K, S, H] keys and values
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(B, T, K, group, H).transpose(0, 2, 3, 1, 4)
    ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    real = (jnp.arange(S)[None, :] >= (S - kv_lengths)[:, None]).astype(jnp.int32)  # [B, S]: 1 real, 0 padding
    # A query's own segment: the real keys' (1) unless the row's queries are its keys and it is padding (T == S).
    q_segment = real if T == S else jnp.ones((B, T), jnp.int32)

    def one_row(qr, kr, vr, q_ids, kv_ids):
        ids = splash.SegmentIds(q=q_ids, kv=kv_ids)
        return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(qr, kr, vr)  # over the K heads

    out = jax.vmap(one_row)(qs, ks, vs, q_segment, real)  # [B, K, group, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)


__all__ = ["IMPLEMENTATIONS", "PROBE_FAILURES", "attention", "cudnn_accepts", "implementation_for",
           "lowering_platform", "platform", "splash_attention", "xla_attention"]
