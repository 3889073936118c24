"""The whole generation for one batch as one `lax.while_loop`: each iteration is one forward pass of the batch.

    out = decode_loop(denoiser, ids, mask, rng, rule, loop=settings, special=special_ids)

The body is the step (`step.denoise_step`: the region's hidden states -> prediction/confidence -> rule ->
commits and remasks) between the pieces `settings` holds: the cache policy (what the pass computes and keeps), the
recorder (what is written down), the stop policy (early stop). The loop itself only does the bookkeeping
that every generation shares: per row, a full block moves the row to its next block (or ends it: last block,
or the stop policy) and resets its rule state; NFE counts the passes in which a row was still working.

Everything is static-shaped and per-row state lives in arrays, so the loop has no host round trip. The
rule's settings are arrays of one value per row (`rule.with_rows`): inputs of the program, not constants,
so a sweep over them runs one compiled program.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from localleap_jax.decode.cache import CachePolicy
from localleap_jax.decode.canvas import Canvas, rows_take, rows_where
from localleap_jax.decode.recorder import Recorder
from localleap_jax.decode.step import Scoring, denoise_step
from localleap_jax.decode.stop import StopPolicy
from localleap_jax.denoiser import Denoiser, SpecialIds
from localleap_jax.rules import RuleTraits, run_init


class LoopSettings(NamedTuple):
    """The compile-time part of a generation (hashable: part of the compiled program's key)."""

    gen_length: int
    block_length: int
    scoring: Scoring
    cache: CachePolicy
    stop: StopPolicy
    recorder: Recorder
    block_grid: bool = False  # blocks on each row's grid from its first real token (block diffusion; canvas.py)
    max_passes: int = 0  # the bound on passes (DecodeConfig.max_passes); 0: one per generated position
    traits: RuleTraits = RuleTraits()  # the rule's static traits (rules.traits_of): region, probes, revokes, ...


class LoopState(NamedTuple):
    x: Int[Array, "B L"]  # the canvas
    block: Int[Array, "B"]  # current block per row
    step_in_block: Int[Array, "B"]  # steps taken in the current block (drives LLaDA's schedule)
    done: Bool[Array, "B"]
    nfe: Int[Array, "B"]
    passes: Int[Array, ""]
    full_passes: Int[Array, ""]
    cache: Any  # the cache policy's state
    rule_state: Any  # the rule's own state, leading axis B
    record: Any  # the recorder's state (() when not recording)
    remasks: Any = ()  # [B] tokens taken back per row, for a rule that revokes (else (): nothing in the program)
    edits: Any = ()  # [B] tokens replaced per row, for a rule that edits (else (): nothing in the program)


class LoopOutput(NamedTuple):
    x: Int[Array, "B L"]
    nfe: Int[Array, "B"]
    passes: Int[Array, ""]
    full_passes: Int[Array, ""]
    record: Any
    remasks: Any = ()
    edits: Any = ()


class Pass(NamedTuple):
    """The per-batch pieces one pass reads besides the state: what the prompts are and how they are decoded."""

    canvas: Canvas  # the rows' layout (a fixed batch: built once; slots: the prompts the slots hold now)
    rule: Any  # the rule with one value per row in every setting
    rule_state0: Any  # a fresh rule state for every row (a row entering a block restarts from it)


def one_pass(denoiser: Denoiser, state: LoopState, at: Pass, rng: jax.Array | None, *, loop: LoopSettings,
             special: SpecialIds) -> tuple[LoopState, Bool[Array, "B"]]:
    """One forward pass of the batch and the bookkeeping after it: (the next state, rows whose block count
    the batch moved on: [B] for rows that
    advance on their own, one value for a cache whose rows advance together; a finished row's slot may take
    its next prompt then)."""
    canvas, rule = at.canvas, at.rule
    B = state.x.shape[0]
    G, T = loop.gen_length, loop.block_length
    region_kind = loop.traits.region  # static: what the rule sees and changes
    block = canvas.block(state.x, state.block)
    region = canvas.region(state.x, block, region_kind)
    refresh = loop.cache.refreshes(state.done, state.step_in_block, state.block)
    hidden = loop.cache.forward(denoiser, canvas, state.x, block, state.cache, refresh,
                                loop.recorder.wants_region or region_kind == "generated", state.done)
    key = None if rng is None else jax.random.fold_in(rng, state.passes)
    step = denoise_step(denoiser.head, hidden.block if region.valid is None else hidden.region, region.tokens,
                        state.done, state.step_in_block, rule, state.rule_state, scoring=loop.scoring,
                        special=special, key=key, gen_length=G, block_length=T, num_blocks=canvas.row_blocks,
                        valid=region.valid, held_out=hidden.held_out, traits=loop.traits, idx=region.idx,
                        prompt_length=canvas.prompt_length)
    x = state.x.at[jnp.arange(B)[:, None], region.idx].set(step.tokens)

    if region.valid is None:  # the block is the region
        block_full = ~jnp.any(step.tokens == special.mask, axis=1)
        block_now = block._replace(tokens=step.tokens)
    else:  # the block ends when nothing up to its end is masked
        block_full = ~jnp.any((step.tokens == special.mask) & region.valid, axis=1)
        block_now = block._replace(tokens=rows_take(x, block.idx))
    if step.finished is not None:  # a rule that ends its own blocks: on the pass it says so, once no mask is left
        block_full &= step.finished
    last_block = state.block == canvas.row_blocks - 1
    stop_here, x = loop.stop.update(x, block_now, block_full, last_block, special, canvas.prompt_length)
    done = state.done | (~state.done & block_full & (last_block | stop_here))
    advance, moved = loop.cache.advances(done, block_full)
    # A row entering a new block starts afresh. (A row with no candidates is done, or waits with a full
    # block for the batch to advance, which resets it: what its update did meanwhile is never read.)
    # A rule whose state spans blocks (Saber's threshold history) keeps it through passes in which its row does not
    # work (waiting for the batch to move, with a cache), as the row alone would never have run them.
    rule_state = (rows_where(advance, at.rule_state0, step.rule_state) if loop.traits.resets_state
                  else rows_where(step.working, step.rule_state, state.rule_state))
    record = loop.recorder.update(state.record, denoiser.head, hidden.region, region, step, state.nfe,
                                  canvas.prompt_length, loop.scoring, special)
    return LoopState(
        x=x,
        block=jnp.where(advance, state.block + 1, state.block),
        step_in_block=jnp.where(moved | done, 0, state.step_in_block + step.working.astype(jnp.int32)),
        done=done,
        nfe=state.nfe + step.working.astype(jnp.int32),
        passes=state.passes + 1,
        full_passes=state.full_passes + refresh.astype(jnp.int32),
        cache=hidden.cache,
        rule_state=rule_state,
        record=record,
        remasks=() if step.remask is None else state.remasks + jnp.sum(step.remask > 0, axis=1, dtype=jnp.int32),
        edits=() if step.edit is None else state.edits + jnp.sum(step.edit > 0, axis=1, dtype=jnp.int32),
    ), moved


def initial_state(denoiser: Denoiser, canvas: Canvas, rule, *, loop: LoopSettings) -> tuple[LoopState, Pass]:
    """The state before the first pass, and the pass's fixed pieces, for the rows of `canvas`."""
    B = canvas.batch
    region = loop.gen_length if loop.traits.region == "generated" else loop.block_length
    rule_state0 = run_init(rule, B, region, denoiser.vocab)
    zeros = jnp.zeros((B,), jnp.int32)
    state = LoopState(canvas.x0, zeros, zeros, jnp.zeros((B,), bool), zeros, jnp.int32(0), jnp.int32(0),
                      loop.cache.init(denoiser, canvas), rule_state0,
                      loop.recorder.init(B, loop.gen_length, loop.max_passes or loop.gen_length, loop.traits.edits),
                      zeros if loop.traits.revokes else (), zeros if loop.traits.edits else ())
    return state, Pass(canvas, rule, rule_state0)


def row_bound(loop: LoopSettings, canvas: Canvas) -> int:
    """Passes a row may work: `max_passes`, or as many as it has positions (a rule that only commits commits at
    least one token per working pass, so that always suffices; one that takes commits back runs to the bound)."""
    return loop.max_passes or canvas.length - canvas.prompt_length


def decode_loop(denoiser: Denoiser, ids: Int[Array, "B P"], mask: Bool[Array, "B P"], rng: jax.Array | None, rule,
                *, loop: LoopSettings, special: SpecialIds) -> LoopOutput:
    """The whole generation for one batch. `rule` has one value per row in every setting (`with_rows`)."""
    canvas = Canvas.build(ids, mask, gen_length=loop.gen_length, block_length=loop.block_length,
                          mask_id=special.mask, shift=denoiser.shift, grid=loop.block_grid)
    state, at = initial_state(denoiser, canvas, rule, loop=loop)
    bound = row_bound(loop, canvas)  # every row works in every pass until it is done: a bound on passes

    def body(state: LoopState) -> LoopState:
        return one_pass(denoiser, state, at, rng, loop=loop, special=special)[0]

    def cond(state: LoopState):
        return ~jnp.all(state.done) & (state.passes < bound)

    state = jax.lax.while_loop(cond, body, state)
    return LoopOutput(state.x, state.nfe, state.passes, state.full_passes, state.record, state.remasks, state.edits)
