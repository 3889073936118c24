"""One batch's canvas: [left-padded prompt (P) | generated positions, in blocks], and row-wise array helpers
every piece of the loop uses.

Bidirectional models (LLaDA, Dream): the generated region is gen_length positions cut into blocks of T from
canvas index P, so a row's current block starts at P + block * T.

Block-diffusion models (SDAR, `grid` = the model's block size = T): blocks lie on each row's own grid, which
starts at its first real token (SDAR's absolute positions). A prompt of n tokens fills n // T whole blocks
(prefilled once); its last partial block is the row's first decoded block, so the row decodes from canvas index
P - n % T, and its blocks end on the grid: ceil((n % T + gen_length) / T) of them, the last possibly past
gen_length (the canvas holds the longest such tail; what lies past a row's grid end is never decoded and no
earlier position sees it). Rows of one batch decode the same number of blocks or one more.

RoPE positions start at each row's first real token, so left padding changes nothing a row computes.
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
    first_start: Int[Array, "B"]  # canvas index where each row's first decoded block starts
    row_blocks: Int[Array, "B"]  # how many blocks each row decodes
    prompt_length: int  # P (padded)
    gen_length: int  # G (what the caller asked for; the canvas may hold a tail past it on a block grid)
    block_length: int  # T
    shift: int  # 1 when position i is predicted from the hidden state at i - 1 (Dream)
    mask_id: int = 0  # the mask token (what a probe copy holds)

    @classmethod
    def build(cls, ids: Int[Array, "B P"], mask: Bool[Array, "B P"], *, gen_length: int, block_length: int,
              mask_id: int, shift: int, grid: bool = False) -> "Canvas":
        """`grid`: blocks lie on each row's grid from its first real token (block diffusion), not from P."""
        B, P = ids.shape
        G, T = gen_length, block_length
        if grid:
            offset = mask.astype(jnp.int32).sum(axis=1) % T  # prompt tokens in the row's first decoded block
            first_start, row_blocks = P - offset, (offset + G + T - 1) // T
            tail = grid_tail(G, T)
        else:
            first_start, row_blocks = jnp.full((B,), P, jnp.int32), jnp.full((B,), G // T, jnp.int32)
            tail = 0
        x0 = jnp.concatenate([ids.astype(jnp.int32), jnp.full((B, G + tail), mask_id, jnp.int32)], axis=1)
        key_mask = jnp.concatenate([mask.astype(bool), jnp.ones((B, G + tail), bool)], axis=1)
        return cls(x0, positions_from_mask(key_mask), key_mask, first_start.astype(jnp.int32),
                   row_blocks.astype(jnp.int32), P, G, T, shift, mask_id)

    @property
    def batch(self) -> int:
        return self.x0.shape[0]

    @property
    def length(self) -> int:  # L = P + G (+ the grid's tail)
        return self.x0.shape[1]

    @property
    def num_blocks(self) -> int:
        """The most blocks any row can decode (the loop's static bound)."""
        return -(-(self.length - self.prompt_length) // self.block_length)

    def block(self, x: Int[Array, "B L"], block: Int[Array, "B"]) -> "Block":
        """Each row's current block of the canvas x."""
        starts = self.first_start + block * self.block_length
        idx = starts[:, None] + jnp.arange(self.block_length)
        return Block(starts, idx, rows_take(x, idx))


    def region(self, x: Int[Array, "B L"], block: "Block", kind: str) -> "Region":
        """What a rule sees and changes: its current block ("block"), or the generated region with the positions
        up to the current block's end valid ("generated": Saber, ReMDM)."""
        if kind == "block":
            return Region(block.idx, block.tokens, None)
        idx = jnp.broadcast_to(self.prompt_length + jnp.arange(self.gen_length), (self.batch, self.gen_length))
        return Region(idx, rows_take(x, idx), idx < (block.starts + self.block_length)[:, None])


class Region(NamedTuple):
    """The positions a rule sees: canvas indices, what they hold, which of them it may touch (None: all)."""

    idx: Int[Array, "B R"]
    tokens: Int[Array, "B R"]
    valid: Bool[Array, "B R"] | None


def grid_tail(gen_length: int, block_length: int) -> int:
    """Positions past gen_length a row on its own block grid may decode: its blocks end on the grid."""
    T = block_length
    return max(-(-(o + gen_length) // T) * T - o for o in range(T)) - gen_length


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
