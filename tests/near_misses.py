"""Near misses of the model's numerics: each is what a plausible slip would compute instead. The parity
tests must fail on every one of them (which is what sets their tolerances' upper bound)."""

import jax
import jax.numpy as jnp
import numpy as np


def rms_eps_outside_sqrt(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return scale * (x32 / (jnp.sqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True)) + eps)).astype(x.dtype)


def rms_eps_after_rsqrt(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return scale * (x32 * (jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True)) + eps)).astype(x.dtype)


def rope_interleaved(x, positions, theta, rotary_dim=None):
    """GPT-J's convention: rotate the pairs (x[2i], x[2i+1]), not the halves."""
    H = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None, None] * (theta ** (-np.arange(0, H, 2, dtype=np.float32) / H))
    x32 = x.astype(jnp.float32)
    even, odd = x32[..., ::2], x32[..., 1::2]
    out = jnp.stack([even * jnp.cos(angles) - odd * jnp.sin(angles), even * jnp.sin(angles) + odd * jnp.cos(angles)], -1)
    return out.reshape(x.shape).astype(x.dtype)
