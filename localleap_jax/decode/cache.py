"""Cache policies: what each forward pass of the loop computes, and what it keeps for the next.

    state = policy.init(denoiser, canvas)
    refresh = policy.refreshes(done, step_in_block)          # this pass runs the whole canvas
    hidden = policy.forward(denoiser, canvas, x, block, state, refresh, want_region)

`hidden.block` are the hidden states that predict each row's current block; `hidden.region` those that
predict the whole generated region, when the caller wants them (a trace) and the pass computed them (else
None). A new mode is a new policy object here; the loop never branches on which one it holds.

  none    every pass runs the whole canvas
  prefix  Fast-dLLM's prefix cache: a full pass when a block starts stores every layer's K/V; later passes
          run the generated region from the block on, reading the cached K/V before it
  dual    Fast-dLLM's dual cache: as prefix, but later passes run only the block (the suffix is cached too)

With a cache the rows advance through blocks together (`advances`), so one full-canvas refresh per
block serves the whole batch. The cost: a row that fills its block early waits (no commits, no NFE) while
the batch still runs forward passes for the slowest row, so the batch makes sum over blocks of the slowest
row's steps passes instead of the slowest row's total. The alternative, refreshing all rows whenever any row
starts a block, turns most passes into full forwards once rows drift apart at B > 1. bench_decode.py reports
both the passes and the full passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.decode.canvas import Block, Canvas, rows_take
from localleap_jax.model import CacheWrite


class Hidden(NamedTuple):
    block: Float[Array, "B T D"]  # the hidden states that predict each row's current block
    region: Float[Array, "B G D"] | None  # those that predict the generated region (asked for and computed)
    cache: Any  # the policy's state after this pass


class CachePolicy(Protocol):
    name: str

    def init(self, denoiser, canvas: Canvas) -> Any: ...

    def refreshes(self, done: Bool[Array, "B"], step_in_block: Int[Array, "B"]) -> Bool[Array, ""]: ...

    def forward(self, denoiser, canvas: Canvas, x: Int[Array, "B L"], block: Block, state: Any,
                refresh: Bool[Array, ""], want_region: bool) -> Hidden: ...

    def advances(self, done: Bool[Array, "B"], block_full: Bool[Array, "B"]
                 ) -> tuple[Bool[Array, "B"], Bool[Array, "B"]]:
        """(rows that move to their next block, rows whose block step count restarts) after this pass."""
        ...


def _from_full(h_all: Float[Array, "B L D"], canvas: Canvas, block: Block, want_region: bool):
    """From a whole-canvas pass: the hidden states that predict the block, and (if wanted) the region."""
    P, L, shift = canvas.prompt_length, canvas.length, canvas.shift
    h_block = rows_take(h_all, block.idx - shift if shift else block.idx)
    return h_block, h_all[:, P - shift:L - shift] if want_region else None


@dataclasses.dataclass(frozen=True)
class NoCache:
    """Every pass runs the whole canvas; rows advance through blocks on their own."""

    name: ClassVar[str] = "none"

    def init(self, denoiser, canvas):
        return ()

    def advances(self, done, block_full):
        return block_full & ~done, block_full

    def refreshes(self, done, step_in_block):
        return jnp.bool_(True)

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region):
        h_all, _ = denoiser.full(x, canvas.positions, canvas.key_mask)
        return Hidden(*_from_full(h_all, canvas, block, want_region), ())


@dataclasses.dataclass(frozen=True)
class _RefreshedPerBlock:
    """A K/V cache refreshed by a full forward when the (shared) block starts: Fast-dLLM's schedule."""

    name: ClassVar[str]
    region_on_refresh: ClassVar[bool]  # the refresh pass reports the region (prefix) or not (dual)

    def init(self, denoiser, canvas):
        return denoiser.empty_cache(canvas.batch, canvas.length)

    def advances(self, done, block_full):
        # Together: only when every unfinished row has filled the shared block, so one refresh serves them.
        moved = jnp.all(done | block_full)
        return jnp.broadcast_to(moved & ~done, block_full.shape), moved

    def refreshes(self, done, step_in_block):
        return jnp.any(~done & (step_in_block == 0))

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region):
        def full(_):  # its K/V become the cache for the whole block
            h_all, kv = denoiser.full(x, canvas.positions, canvas.key_mask)
            h_block, h_region = _from_full(h_all, canvas, block, want_region)
            return h_block, h_region if self.region_on_refresh else None, kv

        def cached(_):
            h_block, h_region = self.cached_pass(denoiser, canvas, x, block, state, want_region)
            return h_block, h_region, state

        return Hidden(*jax.lax.cond(refresh, full, cached, None))

    def cached_pass(self, denoiser, canvas, x, block, state, want_region):
        """(hidden states predicting the block, those predicting the region or None) from the cache."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PrefixCache(_RefreshedPerBlock):
    """Runs the block and everything after it, reading the cached K/V of the prefix before the block."""

    name: ClassVar[str] = "prefix"
    region_on_refresh: ClassVar[bool] = True

    def cached_pass(self, denoiser, canvas, x, block, state, want_region):
        # The window is the whole generated region (static shape, plus the position before it with a
        # shift); K/V of its positions before the block come from the cache, so those queries are
        # computed and discarded (or, tracing, recorded).
        P, G, shift = canvas.prompt_length, canvas.gen_length, canvas.shift
        w0 = P - shift
        write = CacheWrite(jnp.full((canvas.batch,), w0, jnp.int32),
                           (w0 + jnp.arange(G + shift))[None, :] >= block.starts[:, None])
        h = denoiser.window(x[:, w0:], canvas.positions[:, w0:], canvas.key_mask, state, write)
        return rows_take(h, block.idx - P), h[:, :G] if want_region else None


@dataclasses.dataclass(frozen=True)
class DualCache(_RefreshedPerBlock):
    """Runs only the block; every other K/V (prefix and suffix) is read from the cache."""

    name: ClassVar[str] = "dual"
    region_on_refresh: ClassVar[bool] = False

    def cached_pass(self, denoiser, canvas, x, block, state, want_region):
        # Queries: the block, and with a shift the position before it, whose hidden state predicts the
        # block's first token (its own K/V stay the cache's).
        T, shift, B = canvas.block_length, canvas.shift, canvas.batch
        win = (block.starts - shift)[:, None] + jnp.arange(T + shift)
        fresh = jnp.broadcast_to(jnp.arange(T + shift) >= shift, (B, T + shift))
        tokens = block.tokens if not shift else rows_take(x, win)
        h = denoiser.window(tokens, rows_take(canvas.positions, win), canvas.key_mask, state,
                            CacheWrite(block.starts - shift, fresh))
        return h[:, :T], None


CACHE_POLICIES: dict[str, CachePolicy] = {p.name: p for p in (NoCache(), PrefixCache(), DualCache())}
CACHE_MODES = tuple(CACHE_POLICIES)
