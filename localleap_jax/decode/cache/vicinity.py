"""dInfer's vicinity refresh (`vicinity`: inclusionAI/dInfer @ fce4e32, `VicinityCacheIteration`,
`DiffusionKVCacheManager`): Fast-dLLM's dual cache with a halo around the block, warmup passes and a periodic refresh.

Per row (each row keeps its own pass counter, so a row decodes as it does alone; dInfer's batched rows share one):
  - `iter_no` counts the row's passes from the start of its generation: warmup, refresh and window passes.
  - While iter_no < warmup, a pass is a whole-canvas pass without a cache; its logits decode the block.
  - Afterwards an iteration is [a refresh pass] then a window pass. A refresh pass runs the whole canvas, decodes the
    block and stores every position's K/V. It runs when the row has no cache yet (the manager is not asked then),
    or when the manager says so in a block after the first: the block changed since the manager was last asked (it
    records the block on every question), or `refresh_every` is set and iter_no % refresh_every == 0. So the first
    cache built in a block after the first is followed by a second refresh, and in the first block the periodic
    refresh never happens.
  - The window pass runs [block start - prefix_look, block end + after_look) (clipped to the canvas) over the cached
    K/V of every other position (the window's own are not written back) and decodes the block.

The window pass after a refresh pass that filled the block would commit nothing: it is not run (the row moves on),
but it is counted in iter_no as dInfer runs it, so the warmup and refresh_every phases stay the authors'. NFE is the
passes run: the authors' count without those no-op window passes.

prefix_look and after_look fix the window's width (static); warmup and refresh_every are traced per row
(refresh_every None, the default: only at block changes, for the whole batch).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int

from localleap_jax.decode.cache.fast_dllm import refresh_in_lanes, when, where_rows
from localleap_jax.decode.cache.protocol import Hidden, PolicyBase, per_row, setting, static_setting
from localleap_jax.decode.canvas import rows_take
from localleap_jax.model import CacheWrite


class VicinityState(NamedTuple):
    kv: object  # every position's K/V from the row's last refresh
    iter_no: Int[Array, "B"]  # the row's passes so far (dInfer's iter_no), the skipped no-op window passes included
    has_cache: Bool[Array, "B"]
    asked: Int[Array, "B"]  # the block the row's manager was last asked about (-1: never)
    pending: Bool[Array, "B"]  # the row's last pass was a refresh: its next is the iteration's window pass
    refreshed: Bool[Array, "B"]  # this pass was a refresh (for `update`)
    warm: Bool[Array, "B"]  # this pass was a warmup pass


@struct.dataclass
class VicinityCache(PolicyBase):
    prefix_look: int = static_setting(16, int, low=0)
    after_look: int = static_setting(16, int, low=0)
    warmup: int = setting(4, int, low=0)
    refresh_every: int | None = setting(None, int, low=1, none_ok=True)

    name: ClassVar[str] = "vicinity"
    computes: ClassVar[str] = "window"
    keeps: ClassVar[str] = "kv"
    refreshes: ClassVar[str] = "block change (twice after the first cache), every refresh_every passes"

    def init(self, denoiser, canvas):
        B = canvas.batch
        zeros, no = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool)
        return VicinityState(denoiser.empty_cache(B, canvas.length), zeros, no, zeros - 1, no, no, no)

    def refill(self, denoiser, canvas, state, rows):
        return state._replace(iter_no=jnp.where(rows, 0, state.iter_no), has_cache=state.has_cache & ~rows,
                              asked=jnp.where(rows, -1, state.asked), pending=state.pending & ~rows)

    def forward(self, denoiser, canvas, x, block, state, view):
        working = ~view.done
        warm = working & (state.iter_no < self.warmup)
        asking = working & ~warm & ~state.pending & state.has_cache
        periodic = (jnp.zeros_like(asking) if self.refresh_every is None
                    else state.iter_no % jnp.maximum(per_row(self.refresh_every, state.iter_no), 1) == 0)
        told = asking & ((state.asked != view.block) | periodic) & (view.block > 0)
        refresh = working & ~warm & ~state.pending & (~state.has_cache | told)
        full = warm | refresh
        h_full, _, kv = refresh_in_lanes(denoiser, canvas, x, block, full, state.kv, False)
        windowed = working & ~full
        h_window = when(jnp.any(windowed), lambda kv: self.window(denoiser, canvas, x, block, kv), kv)
        state = state._replace(kv=kv, asked=jnp.where(asking, view.block, state.asked), refreshed=refresh, warm=warm)
        return Hidden(where_rows(full, h_full, h_window), None, state, full=full)

    def window(self, denoiser, canvas, x, block, kv):
        """[start - prefix_look, end + after_look) over the cache (its own K/V not written back); with a logits shift
        also the position before the block (a query whose K/V stay the cache's, as the dual cache's)."""
        L, T, shift = canvas.length, canvas.block_length, canvas.shift
        left = max(self.prefix_look, shift)
        W = min(L, left + T + self.after_look)
        w0 = jnp.clip(block.starts - left, 0, L - W)
        at = w0[:, None] + jnp.arange(W)
        fresh = (at >= (block.starts - self.prefix_look)[:, None]) & (at < (block.starts + T + self.after_look)[:, None])
        h = denoiser.window(rows_take(x, at), rows_take(canvas.positions, at), canvas.key_mask, kv,
                            CacheWrite(w0, fresh))
        return rows_take(h, block.idx - shift - w0[:, None])

    def update(self, denoiser, state, outcome):
        working = outcome.step.working
        # the window pass after a refresh that filled the block is not run, but dInfer counts it
        skipped = state.refreshed & outcome.advance | state.refreshed & outcome.done
        passes = 1 + skipped.astype(jnp.int32)
        return state._replace(
            iter_no=jnp.where(working, state.iter_no + passes, state.iter_no),
            has_cache=state.has_cache | (working & state.refreshed),
            pending=jnp.where(working, state.refreshed & ~skipped, state.pending))
