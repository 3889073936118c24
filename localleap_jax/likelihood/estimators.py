"""The Monte-Carlo noise of each family's likelihood estimator: which continuation tokens a sample masks, and
the weight of its cross-entropy.

Both are unbiased estimates of the diffusion ELBO of the continuation given the context (the context is never
masked):  log p(y | x) >= -E[ weight * sum over masked j of CE_j ].

    Estimator.draw(key, rows, place, maskable) -> Noise(masked [rows, C], weight [rows])

`place` [C] numbers each window position by its continuation index (0 at the first continuation token,
negative left of it); `maskable` [C] says which positions may be masked. Randomness is drawn per continuation
index (a key folded with it), never per window slot, so a request gets the same noise in any window width,
padding or batch: its estimate does not depend on its neighbours.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


class Noise(NamedTuple):
    masked: Bool[Array, "R C"]  # masked window positions, per sample row
    weight: Float[Array, "R"]  # the weight of that row's summed cross-entropy


class Estimator(Protocol):
    name: str

    def maskable(self, place: Int[Array, "C"], length: Int[Array, ""], sequence_start: Bool[Array, "C"]
                 ) -> Bool[Array, "C"]: ...

    def draw(self, key: jax.Array, rows: int, place: Int[Array, "C"], maskable: Bool[Array, "C"]) -> Noise: ...


def position_uniforms(key: jax.Array, rows: int, place: Int[Array, "C"]) -> Float[Array, "R C"]:
    """U(0, 1) per (row, continuation index): row i's key folded with the index, so the value at a token does not
    depend on where the window puts it."""
    row_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(rows))
    at = jnp.maximum(place, 0)
    return jax.vmap(lambda k: jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(k, j)))(at))(row_keys)


def stratified_counts(k: Int[Array, ""], length: Int[Array, ""], rows: int) -> Int[Array, "R"]:
    """LLaDA's mask counts of one mini-batch: l_i = ((round(k + i L / b) - 1) mod L) + 1, i = 0..b-1.

    LLaDA evaluates round(linspace(k, k + (b-1) L / b, b)) in floats with torch.round (halves to even); the
    points are k + i L / b, so this rounds the exact rational (k b + i L) / b, halves to even, in integers.
    (Equal to torch's floats wherever they are exact, e.g. every L with b a power of two up to 2**24 / L.)"""
    i = jnp.arange(rows)
    numerator = k * rows + i * length
    q, r = numerator // rows, numerator % rows
    rounded = q + jnp.where(2 * r > rows, 1, jnp.where(2 * r == rows, q % 2, 0))
    return (rounded - 1) % length + 1


@dataclasses.dataclass(frozen=True)
class MaskCount:
    """LLaDA (`eval_llada.py` `_forward_process` / `get_loglikelihood`): one k ~ U{1..L} per mini-batch, row i
    masks exactly l_i (`stratified_counts`) of the L continuation tokens, chosen uniformly; weight L / l_i."""

    name: str = "llada"

    def maskable(self, place, length, sequence_start):
        return (place >= 0) & (place < length)

    def draw(self, key, rows, place, maskable):
        length = jnp.sum(maskable)
        count_key, order_key = jax.random.split(key)
        k = jax.random.randint(count_key, (), 1, jnp.maximum(length, 1) + 1)
        counts = stratified_counts(k, jnp.maximum(length, 1), rows)  # [R]
        u = jnp.where(maskable, position_uniforms(order_key, rows, place), 2.0)  # the unmaskable sort last
        rank = jnp.argsort(jnp.argsort(u, axis=1), axis=1)  # a uniform random order of the maskable tokens
        masked = maskable & (rank < counts[:, None])
        return Noise(masked, length.astype(jnp.float32) / counts.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MaskRate:
    """Dream (`eval/eval.py` `_forward_process` with log_type "ftb"): t_i = (u0 + i / b) mod 1 with one u0 per
    mini-batch, p_i = (1 - eps) t_i + eps, each continuation token masked independently with p_i; weight 1 / p_i.
    Dream never masks the sequence's first and last positions: its continuation ends with the EOS its
    `_encode_pair` appends, which is context for the others and never scored."""

    sampling_eps: float = 1e-3
    name: str = "dream"

    def maskable(self, place, length, sequence_start):
        return (place >= 0) & (place < length - 1) & ~sequence_start

    def draw(self, key, rows, place, maskable):
        rate_key, token_key = jax.random.split(key)
        u0 = jax.random.uniform(rate_key, (), jnp.float32)
        t = (u0 + jnp.arange(rows, dtype=jnp.float32) / rows) % 1.0
        p = (1 - self.sampling_eps) * t + self.sampling_eps
        masked = maskable & (position_uniforms(token_key, rows, place) < p[:, None])
        return Noise(masked, 1.0 / p)


def estimator_for(name: str, sampling_eps: float = 1e-3) -> Estimator:
    """The named estimator: "llada" (MaskCount) or "dream" (MaskRate)."""
    return MaskRate(sampling_eps) if name == "dream" else MaskCount()
