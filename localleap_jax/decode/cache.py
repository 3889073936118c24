"""Cache policies: what each forward pass of the loop computes, and what it keeps for the next.

    state = policy.init(denoiser, canvas)
    refresh = policy.refreshes(done, starting, block)        # this pass refreshes what the policy keeps
    hidden = policy.forward(denoiser, canvas, x, block, state, refresh, want_region, done)

`hidden.block` are the hidden states that predict each row's current block; `hidden.region` those that
predict the whole generated region, when the caller wants them (a trace) and the pass computed them (else
None). A new mode is a new policy object here; the loop never branches on which one it holds.

  none    every pass runs the whole canvas
  prefix  Fast-dLLM's prefix cache: a full pass when a block starts stores every layer's K/V; later passes
          run the canvas from the block on (a window of static width per block), reading the cached K/V before it
  dual    Fast-dLLM's dual cache: as prefix, but later passes run only the block (the suffix is cached too)
  block   block diffusion's exact cache (SDAR): attention is block-causal, so the K/V of a finished block
          never change. The prompt's whole blocks are prefilled once; each pass runs only the current
          block; a finished block's K/V are stored by the next block's first pass, which runs both blocks
          (SDAR's loop spends a separate forward on that store). Rows advance on their own. With a logits shift
          (Fast-dLLM v2) the store is a pass of its own, which also yields the next block's first token.
  subblock  Fast-dLLM v2's approximate sub-block cache: as block, but a pass inside a sub-block whose first
          position is decoded runs only the sub-block over the block's stale K/V (decided per row).
  encoder   a uniform-noise canvas model's (DiffusionGemma): the encoder's exact K/V of the prompt and each
          finished canvas (encoded by the row's first pass in the next canvas); the decoder runs the canvas alone,
          with the self-conditioning input the policy carries from pass to pass (`carry`).
  none+soft   (a rule with soft_input: dInfer's iteration smoothing) every pass runs the whole canvas with the input
          embedding the policy carries from pass to pass (`carry`), added to the token embeddings of the generated
          region; the pass reports the whole generated region (the soft input needs its distribution).

A soft input is one mechanism for both policies that carry one: after a pass, `carry(denoiser, state, logits,
weight)` keeps weight * denoiser.soft_embedding(logits) (the embedding the pass's distribution expects, in the
denoiser's own form: DiffusionGemma's scaled by sqrt(D), a masked LM's softmax(logits) @ E) for the next pass, and
the next pass hands it to the denoiser, which takes it its own way (DiffusionGemma's decoder through its
self-conditioning block, a masked LM added to its token embeddings).

With Fast-dLLM's caches (prefix, dual) the rows advance through blocks together (`advances`), so one
full-canvas refresh per block serves the whole batch. The cost: a row that fills its block early waits (no commits, no NFE) while
the batch still runs forward passes for the slowest row, so the batch makes sum over blocks of the slowest
row's steps passes instead of the slowest row's total. The alternative, refreshing all rows whenever any row
starts a block, turns most passes into full forwards once rows drift apart at B > 1. bench_decode.py reports
both the passes and the full passes.

With the block cache rows advance on their own (nothing is refreshed for the batch). Its one shared cost: a
pass is one block wide, or two when any working row starts a block and stores the one before, so once rows
drift apart at B > 1 most passes are two blocks wide (experiments/bench_sdar.py reports how many).
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
    held_out: Float[Array, "B T D"] | None = None  # the block's probe copy (ProbedNoCache): each position hidden


class CachePolicy(Protocol):
    name: str

    def init(self, denoiser, canvas: Canvas) -> Any: ...

    def refreshes(self, done: Bool[Array, "B"], starting: Bool[Array, "B"], block: Int[Array, "B"]
                  ) -> Bool[Array, ""]:
        """Whether this pass refreshes what the policy keeps; `starting`: rows whose pass is the first of their block."""
        ...

    def forward(self, denoiser, canvas: Canvas, x: Int[Array, "B L"], block: Block, state: Any,
                refresh: Bool[Array, ""], want_region: bool, done: Bool[Array, "B"]) -> Hidden: ...

    def advances(self, done: Bool[Array, "B"], block_full: Bool[Array, "B"]
                 ) -> tuple[Bool[Array, "B"], Bool[Array, "B"]]:
        """(rows that move to their next block, rows whose block step count restarts) after this pass."""
        ...

    # Continuous batching (decode/slots.py): whether the rows advance through blocks together (a finished row's
    # slot then takes its next prompt only when the batch moves on), and what a slot taking a new prompt needs of
    # the cache (`rows`: the slots that do; `canvas`: the rows' layout with their new prompts).
    rows_together: bool

    def refill(self, denoiser, canvas: Canvas, state: Any, rows: Bool[Array, "B"]) -> Any: ...


def _from_full(h_all: Float[Array, "B L D"], canvas: Canvas, block: Block, want_region: bool):
    """From a whole-canvas pass: the hidden states that predict the block, and (if wanted) the region."""
    P, L, shift = canvas.prompt_length, canvas.length, canvas.shift
    h_block = rows_take(h_all, block.idx - shift if shift else block.idx)
    return h_block, h_all[:, P - shift:L - shift] if want_region else None


@dataclasses.dataclass(frozen=True)
class NoCache:
    """Every pass runs the whole canvas; rows advance through blocks on their own."""

    name: ClassVar[str] = "none"
    rows_together: ClassVar[bool] = False

    def init(self, denoiser, canvas):
        return ()

    def refill(self, denoiser, canvas, state, rows):
        return state

    def advances(self, done, block_full):
        return block_full & ~done, block_full

    def refreshes(self, done, starting, block):
        return jnp.bool_(True)

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region, done):
        h_all, _ = denoiser.full(x, canvas.positions, canvas.key_mask)
        return Hidden(*_from_full(h_all, canvas, block, want_region), ())


@dataclasses.dataclass(frozen=True)
class _RefreshedPerBlock:
    """A K/V cache refreshed by a full forward when the (shared) block starts: Fast-dLLM's schedule."""

    name: ClassVar[str]
    region_on_refresh: ClassVar[bool]  # the refresh pass reports the region (prefix) or not (dual)
    rows_together: ClassVar[bool] = True

    def init(self, denoiser, canvas):
        return denoiser.empty_cache(canvas.batch, canvas.length)

    def refill(self, denoiser, canvas, state, rows):
        return state  # a slot takes its prompt when the batch moves: the next pass is the full refresh it needs

    def advances(self, done, block_full):
        # Together: only when every unfinished row has filled the shared block, so one refresh serves them.
        moved = jnp.all(done | block_full)
        return jnp.broadcast_to(moved & ~done, block_full.shape), moved

    def refreshes(self, done, starting, block):
        return jnp.any(~done & starting)

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region, done):
        def full(_):  # its K/V become the cache for the whole block
            h_all, kv = denoiser.full(x, canvas.positions, canvas.key_mask)
            h_block, h_region = _from_full(h_all, canvas, block, want_region)
            return h_block, h_region if self.region_on_refresh else None, kv

        def cached(_):
            h_block, h_region = self.cached_pass(denoiser, canvas, x, block, state, want_region, done)
            return h_block, h_region, state

        return Hidden(*jax.lax.cond(refresh, full, cached, None))

    def cached_pass(self, denoiser, canvas, x, block, state, want_region, done):
        """(hidden states predicting the block, those predicting the region or None) from the cache; `done` rows'
        states are never read."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PrefixCache(_RefreshedPerBlock):
    """Runs the block and everything after it, reading the cached K/V of the prefix before the block."""

    name: ClassVar[str] = "prefix"
    region_on_refresh: ClassVar[bool] = True

    # At most this many window widths (each a branch of the program, so a compiled copy of the trunk).
    max_windows: ClassVar[int] = 8

    def cached_pass(self, denoiser, canvas, x, block, state, want_region, done):
        # Fast-dLLM runs x[:, block_start:] against the prefix's cached K/V: a pass costs the block and what
        # follows it. Shapes must be static, so the window starts at one of a few block boundaries (a
        # `lax.switch`, one branch per width): the latest at or before the earliest working row's block (rows of
        # a batch share their block; slots may hold rows on earlier blocks). K/V of the window's positions before
        # a row's block come from the cache, so those queries are computed and discarded. A trace wants the
        # whole generated region: one window from the prompt's end.
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
        first = jnp.min(jnp.where(done, blocks - 1, (block.starts - P) // T))  # the earliest working row's block
        return jax.lax.switch(jnp.clip(first // per_window, 0, len(starts) - 1), [window(w0) for w0 in starts], None)


@dataclasses.dataclass(frozen=True)
class DualCache(_RefreshedPerBlock):
    """Runs only the block; every other K/V (prefix and suffix) is read from the cache."""

    name: ClassVar[str] = "dual"
    region_on_refresh: ClassVar[bool] = False

    def cached_pass(self, denoiser, canvas, x, block, state, want_region, done):
        # Queries: the block, and with a shift the position before it, whose hidden state predicts the
        # block's first token (its own K/V stay the cache's).
        T, shift, B = canvas.block_length, canvas.shift, canvas.batch
        win = (block.starts - shift)[:, None] + jnp.arange(T + shift)
        fresh = jnp.broadcast_to(jnp.arange(T + shift) >= shift, (B, T + shift))
        tokens = block.tokens if not shift else rows_take(x, win)
        h = denoiser.window(tokens, rows_take(canvas.positions, win), canvas.key_mask, state,
                            CacheWrite(block.starts - shift, fresh))
        return h[:, :T], None


@dataclasses.dataclass(frozen=True)
class BlockCache:
    """The exact cache of a block-causal model: K/V of every finished block, read by the blocks after it.

    `refresh` marks the passes that also store the finished previous block (a row's first pass in a block
    after its first): they run a window of two blocks, the previous one with its final tokens (its K/V depend
    only on itself and earlier blocks, so they are exact) and the current one. Every other pass runs the
    current block alone. The window's K/V are always written to the cache; the current block's are rewritten
    by every pass until its final tokens are stored.

    With a logits shift (Fast-dLLM v2) the block's first position is predicted from the position before it, which
    the one-block window takes as one more query (its K/V stay the cache's). That prediction cannot see the block:
    the loop commits it as the block's free token in the store pass (loop.py), as the authors do.
    """

    name: ClassVar[str] = "block"
    rows_together: ClassVar[bool] = False

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

    def advances(self, done, block_full):
        return block_full & ~done, block_full

    def refreshes(self, done, starting, block):
        return jnp.any(~done & starting & (block > 0))

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region, done):
        h_block, cache = jax.lax.cond(refresh, block_window(denoiser, canvas, x, block, 2),
                                      block_window(denoiser, canvas, x, block, 1), state)
        return Hidden(h_block, None, cache)


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


@dataclasses.dataclass(frozen=True)
class SubBlockCache(BlockCache):
    """Fast-dLLM v2's approximate sub-block cache (`use_block_cache=True`), decided per row: a row runs its whole
    block when its block cache is empty (its first pass in the block after the store pass) or when its current
    sub-block's first position is a mask; otherwise only the sub-block runs, reading the other sub-blocks' K/V as
    its last whole-block pass left them (stale: approximate; exact on one layer) and writing its own. The authors
    decide per batch (a whole-block pass when any row needs one), which makes a row's tokens depend on its batch;
    here a pass where rows differ runs both windows and each row takes its own. Its state: the K/V cache, and the
    block each row last ran whole (its block cache's)."""

    sub_block_length: int = 8
    name: ClassVar[str] = "subblock"

    def init(self, denoiser, canvas):
        return super().init(denoiser, canvas), jnp.full((canvas.batch,), -1, jnp.int32)

    def refill(self, denoiser, canvas, state, rows):
        kv, primed = state
        return super().refill(denoiser, canvas, kv, rows), jnp.where(rows, -1, primed)

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region, done):
        kv, primed = state
        T, S, B, shift = canvas.block_length, self.sub_block_length, canvas.batch, canvas.shift
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
            return jax.lax.cond(refresh, block_window(denoiser, canvas, x, block, 2, whole),
                                block_window(denoiser, canvas, x, block, 1, whole), cache)

        def both(cache):
            h_wide, cache = wide(cache)
            h_narrow, cache = narrow(cache)
            return jnp.where(whole[:, None, None], h_wide, h_narrow), cache

        some, every = jnp.any(whole & ~done), jnp.all(whole | done)
        h_block, kv = jax.lax.cond(some, lambda c: jax.lax.cond(every, wide, both, c), narrow, kv)
        # a row's block cache is filled by a whole-block pass over its block (not by a store pass: the block is masks)
        return Hidden(h_block, None, (kv, jnp.where(whole & ~storing, block.starts, primed)))


@dataclasses.dataclass(frozen=True)
class SoftNoCache(NoCache):
    """Every pass runs the whole canvas with a soft input added to the generated region's token embeddings, the one
    the previous pass left (`carry`; none before a row's first pass); rows advance on their own. The state is that
    input, [B, G, D] in the embedding's dtype (G x D x 2 bytes a row in bf16: 2 MB at G 256, D 4096). Its pass
    reports the hidden states of the whole generated region, whose logits make the next input."""

    name: ClassVar[str] = "none+soft"

    def init(self, denoiser, canvas):
        return denoiser.no_soft(canvas.batch, canvas.length - canvas.prompt_length)

    def refill(self, denoiser, canvas, state, rows):
        return jnp.where(rows[:, None, None], jnp.zeros((), state.dtype), state)

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region, done):
        P = canvas.prompt_length
        soft = jnp.concatenate([jnp.zeros((canvas.batch, P, state.shape[-1]), state.dtype), state], axis=1)
        h_all, _ = denoiser.full(x, canvas.positions, canvas.key_mask, soft)
        return Hidden(*_from_full(h_all, canvas, block, True), state)

    def carry(self, denoiser, state, logits: Float[Array, "B G V"], weight: Float[Array, "B G"]):
        """The next pass's input: weight x the embedding this pass's distribution expects, at each generated
        position (weight 0: none)."""
        soft = denoiser.soft_embedding(logits)
        return (weight[..., None].astype(soft.dtype) * soft).astype(state.dtype)


@dataclasses.dataclass(frozen=True)
class ProbedNoCache(NoCache):
    """Every pass runs the whole canvas and, in the same forward pass, a probe copy of the block
    (`Denoiser.probe`): hidden states that score each block position with that position hidden (WINO's
    verification). Cost: T more queries and keys per pass (L + T instead of L) under an explicit attention mask
    (XLA's attention path, never cuDNN's)."""

    name: ClassVar[str] = "none+probe"

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region, done):
        h_all, held_out = denoiser.probe(x, canvas.positions, canvas.key_mask, block.idx, canvas.mask_id)
        h_block, h_region = _from_full(h_all, canvas, block, want_region)
        return Hidden(h_block, h_region, (), held_out)


class CanvasCacheState(NamedTuple):
    encoder: Any  # the denoiser's encoder cache: prompt and finished canvases, a static-shape K/V buffer per row
    soft: Float[Array, "B C D"]  # each row's self-conditioning input for its next pass (no_soft on a canvas's first)
    encoded: Int[Array, "B"]  # canvases each row has encoded (its K/V holds its prompt and these)


@dataclasses.dataclass(frozen=True)
class CanvasEncoderCache:
    """A uniform-noise canvas model's cache (DiffusionGemma, a `CanvasDenoiser`; the one policy of a canvas rule).

    The encoder's K/V of each row's prompt (encoded once, by `init`) and of its finished canvases, in a buffer of
    static shape; the decoder runs the row's current canvas over it. A row's first pass in a canvas after its first
    also encodes its finished canvas (the argmax canvas the loop kept) before the decoder runs: those passes run the
    encoder over the batch, for the rows that start (a `lax.cond`: passes where no row starts run the decoder
    alone). Beside the K/V the policy keeps each row's self-conditioning input: after a pass, `carry` makes it from
    the pass's temperature-scaled logits (none for a row whose canvas just finished: its next pass starts one).
    Rows advance on their own."""

    name: ClassVar[str] = "encoder"
    rows_together: ClassVar[bool] = False

    def init(self, denoiser, canvas):
        B, P = canvas.batch, canvas.prompt_length
        encoder = denoiser.encode(denoiser.empty_cache(B, canvas.length), canvas.x0[:, :P], canvas.key_mask[:, :P])
        return CanvasCacheState(encoder, denoiser.no_soft(B, canvas.block_length), jnp.zeros((B,), jnp.int32))

    def refill(self, denoiser, canvas, state, rows):
        def prefill(st: CanvasCacheState):  # the new prompts, encoded into the slots that take them only
            P = canvas.prompt_length
            encoder = denoiser.encode(denoiser.restart(st.encoder, rows), canvas.x0[:, :P], canvas.key_mask[:, :P],
                                      rows)
            soft = jnp.where(rows[:, None, None], denoiser.no_soft(canvas.batch, canvas.block_length), st.soft)
            return CanvasCacheState(encoder, soft, jnp.where(rows, 0, st.encoded))
        return jax.lax.cond(jnp.any(rows), prefill, lambda st: st, state)

    def advances(self, done, block_full):
        return block_full & ~done, block_full

    def refreshes(self, done, starting, block):
        return jnp.any(~done & starting & (block > 0))  # some row starts a canvas after its first: encode first

    def forward(self, denoiser, canvas, x, block, state, refresh, want_region, done):
        T = canvas.block_length
        current = (block.starts - canvas.first_start) // T  # each row's canvas index

        def encode_finished(st: CanvasCacheState):
            rows = ~done & (st.encoded < current)
            kept = rows_take(x, block.idx - T)  # the canvas before: what the loop kept of it
            encoder = denoiser.encode(st.encoder, kept, jnp.ones(kept.shape, bool), rows)
            return st._replace(encoder=encoder, encoded=jnp.where(rows, st.encoded + 1, st.encoded))

        state = jax.lax.cond(refresh, encode_finished, lambda st: st, state)
        return Hidden(denoiser.decode(state.encoder, block.tokens, state.soft), None, state)

    def carry(self, denoiser, state: CanvasCacheState, scaled: Float[Array, "B C V"], weight: Float[Array, "B C"]
              ) -> CanvasCacheState:
        """The state for the next pass: each row's self-conditioning input from this pass's temperature-scaled
        logits, weight 1 (none, weight 0, where the row's canvas just finished)."""
        soft = denoiser.soft_embedding(scaled)
        soft = jnp.where(weight[..., None] > 0, weight[..., None].astype(soft.dtype) * soft, jnp.zeros((), soft.dtype))
        return state._replace(soft=soft.astype(state.soft.dtype))


CACHE_POLICIES: dict[str, CachePolicy] = {p.name: p for p in (NoCache(), PrefixCache(), DualCache(), BlockCache(),
                                                               SubBlockCache(), CanvasEncoderCache())}
# (ProbedNoCache and SoftNoCache are "none" as the rule that needs one runs it: chosen by DecodeConfig.loop_settings.)
# The modes that fit each kind of attention: Fast-dLLM's caches approximate a bidirectional model; the block
# cache is exact only where attention is block-causal (and there "none" recomputes the same K/V every pass).
BIDIRECTIONAL_CACHES = ("none", "prefix", "dual")
BLOCK_CAUSAL_CACHES = ("block", "subblock", "none")
CANVAS_CACHES = ("encoder",)  # a uniform-noise canvas model's (DiffusionGemma): its encoder's K/V
CACHE_MODES = tuple(CACHE_POLICIES)
