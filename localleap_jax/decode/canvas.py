"""One batch's canvas: [left-padded prompt (P) | gen_length generated positions, in blocks], and row-wise
array helpers every piece of the loop uses.

A row's current block starts at canvas index P + block * T. RoPE positions start at each row's first
real token, so left padding changes nothing a row computes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from localleap_jax.model import positions_from_mask


@dataclasses.dataclass(frozen=True)
class Canvas:
    """The static layout (P, G, T, shift: Python ints) and the arrays every pass reads."""

    x0: Int[Array, "B L"]  # the prompt, then G mask tokens
    positions: Int[Array, "B L"]  # RoPE positions (0 at each row's first real token)
    key_mask: Bool[Array, "B L"]  # False on left padding
    prompt_length: int  # P (padded)
    gen_length: int  # G
    block_length: int  # T
    shift: int  # 1 when position i is predicted from the hidden state at i - 1 (Dream)

    @classmethod
    def build(cls, ids: Int[Array, "B P"], mask: Bool[Array, "B P"], *, gen_length: int, block_length: int,
              mask_id: int, shift: int) -> "Canvas":
        B, P = ids.shape
        x0 = jnp.concatenate([ids.astype(jnp.int32), jnp.full((B, gen_length), mask_id, jnp.int32)], axis=1)
        key_mask = jnp.concatenate([mask.astype(bool), jnp.ones((B, gen_length), bool)], axis=1)
        return cls(x0, positions_from_mask(key_mask), key_mask, P, gen_length, block_length, shift)

    @property
    def batch(self) -> int:
        return self.x0.shape[0]

    @property
    def length(self) -> int:  # L = P + G
        return self.prompt_length + self.gen_length

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    def block(self, x: Int[Array, "B L"], block: Int[Array, "B"]) -> "Block":
        """Each row's current block of the canvas x."""
        starts = self.prompt_length + block * self.block_length
        idx = starts[:, None] + jnp.arange(self.block_length)
        return Block(starts, idx, rows_take(x, idx))


class Block(NamedTuple):
    """Each row's current block: where it starts, its canvas indices and the tokens it holds."""

    starts: Int[Array, "B"]  # canvas index of the block's first position
    idx: Int[Array, "B T"]  # canvas indices of its positions
    tokens: Int[Array, "B T"]  # what the canvas holds there


def rows_take(a: Array, idx: Int[Array, "B T"]) -> Array:
    """a[b, idx[b, t], ...] for every row b."""
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


def rows_where(rows: Bool[Array, "B"], new, old):
    """Per row of every leaf: `new` where rows[b], else `old`."""
    return jax.tree.map(lambda n, o: jnp.where(rows.reshape(rows.shape + (1,) * (n.ndim - 1)), n, o), new, old)
