"""Block diffusion's exact cache (`block`, SDAR) and Fast-dLLM v2's approximate sub-block cache (`subblock`)."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int

from localleap_jax.decode.cache.protocol import Hidden, PolicyBase
from localleap_jax.decode.canvas import Block, Canvas, rows_take
from localleap_jax.model import CacheWrite


@struct.dataclass
class BlockCache(PolicyBase):
    """The exact cache of a block-causal model: K/V of every finished block, read by the blocks after it.

    The prompt's whole blocks are prefilled once; each pass runs only the current block; a finished block's K/V
    are stored by the next block's first pass, which runs both blocks (SDAR's loop spends a separate forward on
    that store). Rows advance on their own. With a logits shift (Fast-dLLM v2) the store is a pass of its own,
    which also yields the next block's first token.

    The passes that also store the finished previous block (a row's first pass in a block after its first) run a
    window of two blocks, the previous one with its final tokens (its K/V depend only on itself and earlier blocks,
    so they are exact) and the current one. Every other pass runs the current block alone. The window's K/V are
    always written to the cache; the current block's are rewritten by every pass until its final tokens are stored.
    Its one shared cost: a pass is one block wide, or two when any working row starts a block and stores the one
    before, so once rows drift apart at B > 1 most passes are two blocks wide (experiments/bench_sdar.py reports how
    many).

    With a logits shift (Fast-dLLM v2) the block's first position is predicted from the position before it, which
    the one-block window takes as one more query (its K/V stay the cache's). That prediction cannot see the block:
    the loop commits it as the block's free token in the store pass (loop.py), as the authors do.
    """

    name: ClassVar[str] = "block"
    fits: ClassVar[tuple[str, ...]] = ("block_causal",)
    computes: ClassVar[str] = "block"
    keeps: ClassVar[str] = "kv"
    refreshes: ClassVar[str] = "never (exact)"

    def refill(self, denoiser, canvas, state, rows):
        # The new prompts' whole blocks, prefilled as `init` does, into the slots that take them only.
        def prefill(cache):
            B, P = canvas.batch, canvas.prompt_length
            write = CacheWrite(jnp.zeros((B,), jnp.int32), jnp.broadcast_to(rows[:, None], (B, P)))
            return denoiser.window_stored(canvas.x0[:, :P], canvas.positions[:, :P], canvas.key_mask, cache,
                                          write)[1]
        return jax.lax.cond(jnp.any(rows), prefill, lambda cache: cache, state)

    def init(self, denoiser, canvas):
        # Prefill: the prompt region [0, P) once. Its whole blocks see only themselves and earlier blocks, so
        # their K/V are final; the partial last block is the first decoded block, rewritten by every pass.
        B, P = canvas.batch, canvas.prompt_length
        write = CacheWrite(jnp.zeros((B,), jnp.int32), jnp.ones((B, P), bool))
        _, cache = denoiser.window_stored(canvas.x0[:, :P], canvas.positions[:, :P], canvas.key_mask,
                                          denoiser.empty_cache(B, canvas.length), write)
        return cache

    @staticmethod
    def storing(view) -> Bool[Array, "B"]:
        """Rows whose pass also stores the finished block before theirs."""
        return ~view.done & view.starting & (view.block > 0)

    def forward(self, denoiser, canvas, x, block, state, view):
        stores = self.storing(view)
        h_block, cache = jax.lax.cond(jnp.any(stores), block_window(denoiser, canvas, x, block, 2),
                                      block_window(denoiser, canvas, x, block, 1), state)
        return Hidden(h_block, None, cache, full=stores)


def block_window(denoiser, canvas: Canvas, x: Int[Array, "B L"], block: Block, width: int,
                 rows: Bool[Array, "B"] | None = None):
    """A pass over the `width` blocks ending with each row's current one (static shape), and with a logits shift
    (width 1) the position before them: cache -> (the hidden states that predict the block [B, T, D], the cache
    with the window's K/V written, for `rows` only when given)."""
    T, B, shift = canvas.block_length, canvas.batch, canvas.shift
    extra = shift if width == 1 else 0  # a two-block window already holds the position before the block
    n = width * T + extra

    def go(cache):
        win = (block.starts - (width - 1) * T - extra)[:, None] + jnp.arange(n)
        fresh = jnp.broadcast_to(jnp.arange(n) >= extra, (B, n))
        if rows is not None:
            fresh = fresh & rows[:, None]
        h, cache = denoiser.window_stored(rows_take(x, win), rows_take(canvas.positions, win), canvas.key_mask,
                                          cache, CacheWrite(win[:, 0], fresh))
        return h[:, n - T - shift:n - shift], cache
    return go


@struct.dataclass
class SubBlockCache(BlockCache):
    """Fast-dLLM v2's approximate sub-block cache (`use_block_cache=True`), decided per row: a row runs its whole
    block when its block cache is empty (its first pass in the block after the store pass) or when its current
    sub-block's first position is a mask; otherwise only the sub-block runs, reading the other sub-blocks' K/V as
    its last whole-block pass left them (stale: approximate; exact on one layer) and writing its own. The authors
    decide per batch (a whole-block pass when any row needs one), which makes a row's tokens depend on its batch;
    here a pass where rows differ runs both windows and each row takes its own. Its state: the K/V cache, and the
    block each row last ran whole (its block cache's)."""

    sub_block_length: int = struct.field(pytree_node=False, default=8)
    name: ClassVar[str] = "subblock"
    refreshes: ClassVar[str] = "sub-block start"

    def init(self, denoiser, canvas):
        return super().init(denoiser, canvas), jnp.full((canvas.batch,), -1, jnp.int32)

    def refill(self, denoiser, canvas, state, rows):
        kv, primed = state
        return super().refill(denoiser, canvas, kv, rows), jnp.where(rows, -1, primed)

    def forward(self, denoiser, canvas, x, block, state, view):
        kv, primed = state
        T, S, B, shift = canvas.block_length, self.sub_block_length, canvas.batch, canvas.shift
        done, stores = view.done, self.storing(view)
        is_mask = block.tokens == canvas.mask_id
        sub = jnp.argmax(is_mask.reshape(B, T // S, S).any(axis=2), axis=1)  # the first sub-block holding a mask
        sub_start = block.starts + sub * S
        # a free-token pass (loop.py): it stores the block before, or reads the prompt's end; the block is all masks
        storing = is_mask[:, 0] & ((block.starts > canvas.first_start) | (canvas.first_start == canvas.prompt_length))
        whole = storing | (primed != block.starts) | is_mask[jnp.arange(B), sub * S]

        def narrow(cache):  # the sub-block alone (and the position before it, with a shift), over the cache
            n = S + shift
            win = (sub_start - shift)[:, None] + jnp.arange(n)
            fresh = (jnp.arange(n) >= shift)[None, :] & ~whole[:, None]
            h, cache = denoiser.window_stored(rows_take(x, win), rows_take(canvas.positions, win), canvas.key_mask,
                                              cache, CacheWrite(win[:, 0], fresh))
            at = sub[:, None] * S + jnp.arange(S)  # put the sub-block's states at their places in the block
            return jnp.zeros((B, T, h.shape[-1]), h.dtype).at[jnp.arange(B)[:, None], at].set(h[:, :S]), cache

        def wide(cache):
            return jax.lax.cond(jnp.any(stores), block_window(denoiser, canvas, x, block, 2, whole),
                                block_window(denoiser, canvas, x, block, 1, whole), cache)

        def both(cache):
            h_wide, cache = wide(cache)
            h_narrow, cache = narrow(cache)
            return jnp.where(whole[:, None, None], h_wide, h_narrow), cache

        some, every = jnp.any(whole & ~done), jnp.all(whole | done)
        h_block, kv = jax.lax.cond(some, lambda c: jax.lax.cond(every, wide, both, c), narrow, kv)
        # a row's block cache is filled by a whole-block pass over its block (not by a store pass: the block is masks)
        return Hidden(h_block, None, (kv, jnp.where(whole & ~storing, block.starts, primed)), full=stores)
