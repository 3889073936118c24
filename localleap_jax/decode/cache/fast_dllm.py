"""Fast-dLLM's approximate K/V caches (`prefix`, `dual`), refreshed per row.

A row's first pass in each block runs the whole canvas, decodes the block from its logits, and stores every layer's
K/V (the refresh); its later passes in the block run only the block (dual) or the canvas from the block on (prefix),
reading every other K/V from what the refresh stored. Each row refreshes when its own block starts: in a pass where
some rows refresh, those run the whole canvas in lanes (passes.in_lanes) and the others take their cached pass, so
no row waits for another and continuous batching refills a slot as soon as its row finishes.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array

from localleap_jax.decode.cache.passes import in_lanes
from localleap_jax.decode.cache.protocol import Hidden, PolicyBase, from_full
from localleap_jax.decode.canvas import Block, rows_take
from localleap_jax.model import CacheWrite


def when(pred, fn, operand):
    """fn(operand) where `pred`, else zeros of its shapes (a pass no row needs is not run)."""
    shapes = jax.eval_shape(fn, operand)
    return jax.lax.cond(pred, fn, lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), operand)


def when_else(pred, fn, state):
    """fn(state) -> (out, state) where `pred`, else (zeros of out's shapes, state)."""
    shapes = jax.eval_shape(fn, state)[0]
    return jax.lax.cond(pred, fn, lambda st: (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), st),
                        state)


def lane_block(block: Block, idx) -> Block:
    return Block(block.starts[idx], block.idx[idx], block.tokens[idx])


def refresh_in_lanes(denoiser, canvas, x, block, rows, kv, want_region: bool):
    """The whole canvas for `rows` (in lanes), their K/V stored: (h_block [B, T, D], h_region [B, G, D] or None, kv);
    zeros at the other rows."""
    def full(idx, valid):
        h_all, new = denoiser.full(x[idx], canvas.positions[idx], canvas.key_mask[idx])
        return from_full(h_all, canvas, lane_block(block, idx), want_region), new

    (h_block, h_region), kv = in_lanes(rows, full, kv, gather=getattr(denoiser, "lanes", True))
    return h_block, h_region, kv


def where_rows(rows, a, b):
    if a is None or b is None:
        return None
    return jnp.where(rows.reshape(rows.shape + (1,) * (a.ndim - 1)), a, b)


@struct.dataclass
class _RefreshedPerBlock(PolicyBase):
    """A K/V cache refreshed by a whole-canvas pass when a row's block starts: Fast-dLLM's schedule, per row."""

    keeps: ClassVar[str] = "kv"
    refreshes: ClassVar[str] = "block start"
    region_on_refresh: ClassVar[bool]  # the refresh pass reports the region (prefix) or not (dual)

    def init(self, denoiser, canvas):
        return denoiser.empty_cache(canvas.batch, canvas.length)

    def refreshing(self, view) -> Array:
        """[B] rows whose pass refreshes (Fast-dLLM: a row's first pass in each block). A policy of the same kind
        with another schedule overrides this alone."""
        return view.starting & ~view.done

    def forward(self, denoiser, canvas, x, block, state, view):
        refresh = self.refreshing(view) & ~view.done
        want = view.want_region and self.region_on_refresh
        h_full, r_full, kv = refresh_in_lanes(denoiser, canvas, x, block, refresh, state, want)
        cached = ~view.done & ~refresh
        h_cached, r_cached = when(jnp.any(cached), lambda kv: self.cached_pass(
            denoiser, canvas, x, block, kv, view.want_region, ~cached), kv)
        region = where_rows(refresh, r_full, r_cached) if want else r_cached
        return Hidden(where_rows(refresh, h_full, h_cached), region, kv, full=refresh)

    def cached_pass(self, denoiser, canvas, x, block, state, want_region, idle):
        """(hidden states predicting the block, those predicting the region or None) from the cache; `idle` rows'
        are never read."""
        raise NotImplementedError


@struct.dataclass
class PrefixCache(_RefreshedPerBlock):
    """Runs the block and everything after it, reading the cached K/V of the prefix before the block."""

    name: ClassVar[str] = "prefix"
    computes: ClassVar[str] = "window"
    region_on_refresh: ClassVar[bool] = True
    region: ClassVar[bool] = True

    # At most this many window widths (each a branch of the program, so a compiled copy of the trunk).
    max_windows: ClassVar[int] = 8

    def cached_pass(self, denoiser, canvas, x, block, state, want_region, idle):
        # Fast-dLLM runs x[:, block_start:] against the prefix's cached K/V: a pass costs the block and what
        # follows it. Shapes must be static, so the window starts at one of a few block boundaries (a
        # `lax.switch`, one branch per width): the latest at or before the earliest working row's block (rows of
        # a batch may be on different blocks). K/V of the window's positions before a row's block come from the
        # cache, so those queries are computed and discarded. A trace wants the whole generated region: one
        # window from the prompt's end.
        P, G, T, shift = canvas.prompt_length, canvas.gen_length, canvas.block_length, canvas.shift
        blocks = G // T
        per_window = 1 if want_region else -(-blocks // self.max_windows)  # blocks between two window starts
        starts = [P - shift + k * T for k in range(0, 1 if want_region else blocks, per_window)]

        def window(w0: int):  # hidden states of canvas positions [w0, L)
            def run(_):
                write = CacheWrite(jnp.full((canvas.batch,), w0, jnp.int32),
                                   (w0 + jnp.arange(canvas.length - w0))[None, :] >= block.starts[:, None])
                h = denoiser.window(x[:, w0:], canvas.positions[:, w0:], canvas.key_mask, state, write)
                # the states that predict the block (with a shift, each is one position before it)
                return rows_take(h, block.idx - shift - w0), h[:, :G] if want_region else None
            return run

        if len(starts) == 1:
            return window(starts[0])(None)
        first = jnp.min(jnp.where(idle, blocks - 1, (block.starts - P) // T))  # the earliest working row's block
        return jax.lax.switch(jnp.clip(first // per_window, 0, len(starts) - 1), [window(w0) for w0 in starts], None)


@struct.dataclass
class DualCache(_RefreshedPerBlock):
    """Runs only the block; every other K/V (prefix and suffix) is read from the cache."""

    name: ClassVar[str] = "dual"
    computes: ClassVar[str] = "block"
    region_on_refresh: ClassVar[bool] = False

    def cached_pass(self, denoiser, canvas, x, block, state, want_region, idle):
        # Queries: the block, and with a shift the position before it, whose hidden state predicts the
        # block's first token (its own K/V stay the cache's).
        T, shift, B = canvas.block_length, canvas.shift, canvas.batch
        win = (block.starts - shift)[:, None] + jnp.arange(T + shift)
        fresh = jnp.broadcast_to(jnp.arange(T + shift) >= shift, (B, T + shift))
        tokens = block.tokens if not shift else rows_take(x, win)
        h = denoiser.window(tokens, rows_take(canvas.positions, win), canvas.key_mask, state,
                            CacheWrite(block.starts - shift, fresh))
        return h[:, :T], None

