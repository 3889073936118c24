"""Continuous batching: N prompts through S slots inside one `lax.while_loop`.

    out = decode_slots(denoiser, ids, mask, rng, PerRow(rule, cache), loop=settings, special=special_ids, slots=S)

A fixed batch lasts as long as its slowest row: with early stop, or a rule that commits at different rates per
row, most rows sit finished while the last one works. Here the loop holds S rows (the slots) and a queue of all N
prompts on the device. Each iteration is the fixed batch's pass (`loop.one_pass`); after it, a slot whose row
finished hands the row to the per-prompt results (canvas, NFE, trace, remasks, edits) and takes the next queued prompt
at once: every cache policy decides per row (a new row's first pass is its own refresh, in a lane), so the new
prompt's first pass is the next.

The refill is a static-shape masked update of every per-row leaf (canvas, layout, rule settings and state,
trace buffers, block counters, the rule's and the cache policy's settings); the cache policy does what a new prompt
needs of its cache (`refill`: the block cache prefills it, the field's caches restart the row's schedule). No row reads another's values, so a prompt's tokens are those it gets decoded alone (greedy
decoding; a sampled row's draws depend on its slot and pass, as a fixed batch's depend on its row).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from localleap_jax.decode.canvas import Canvas, rows_where
from localleap_jax.decode import progress
from localleap_jax.decode.draws import PromptDraws
from localleap_jax.decode.loop import (LoopOutput, LoopSettings, LoopState, Pass, PerRow, initial_state, one_pass,
                                       per_row_settings, row_bound)
from localleap_jax.denoiser import Denoiser, SpecialIds

_LAYOUT = ("x0", "positions", "key_mask", "first_start", "row_blocks")  # a Canvas's per-row arrays


class Results(NamedTuple):
    """What each prompt leaves behind, [N, ...], written when its row finishes."""

    x: Int[Array, "N L"]
    nfe: Int[Array, "N"]
    record: Any  # the recorder's per-row state, one per prompt
    remasks: Any  # [N] (a rule that revokes) or ()
    edits: Any = ()  # [N] (a rule that edits) or ()
    indels: Any = ()  # ([N] inserted, [N] dropped) (a rule that rewrites) or ()


class SlotState(NamedTuple):
    loop: LoopState  # the S slots' rows, as a fixed batch's
    layout: tuple  # the slots' Canvas arrays (_LAYOUT), from the prompts they hold
    rule: Any  # the rule's and the cache policy's settings of the prompts the slots hold (PerRow), [S] per setting
    prompt: Int[Array, "S"]  # the prompt each slot holds (-1: none: finished, handed over, nothing left to take)
    queued: Int[Array, ""]  # the next prompt to take
    results: Results


def take_rows(tree, idx: Int[Array, "S"]):
    """Rows idx of every leaf (leading axis: prompts)."""
    return jax.tree.map(lambda a: a[idx], tree)


def write_rows(results, rows, dest: Int[Array, "S"]):
    """results[dest[s]] = rows[s] for every leaf; dest N (out of range) writes nothing."""
    return jax.tree.map(lambda r, new: r.at[dest].set(new.astype(r.dtype), mode="drop"), results, rows)


def decode_slots(denoiser: Denoiser, ids: Int[Array, "N P"], mask: Bool[Array, "N P"], rng: jax.Array | None,
                 rule: PerRow, draws: PromptDraws | None = None, *, loop: LoopSettings, special: SpecialIds,
                 slots: int, report: bool = False) -> LoopOutput:
    """The whole generation of N prompts through min(slots, N) rows; outputs in prompt order. `rule`: the rule and
    the cache policy with one value per prompt in every setting (`with_rows(N)`); `draws`: a canvas rule's, per
    prompt. `report`: after every pass, the prompts that finished in it go to `progress.report` (the caller's
    listener)."""
    N = ids.shape[0]
    S = min(slots, N)
    queue = Canvas.build(ids, mask, gen_length=loop.gen_length, block_length=loop.block_length,
                         mask_id=special.mask, shift=denoiser.shift, grid=loop.block_grid)
    first = jnp.arange(S)
    canvas0 = dataclasses.replace(queue, **{f: getattr(queue, f)[:S] for f in _LAYOUT})
    rule = per_row_settings(rule, loop)
    rule0 = take_rows(rule, first)
    state0, at0 = initial_state(denoiser, canvas0, rule0, loop=loop, draws=draws)
    fresh = (state0.rule_state, state0.record, state0.remasks, state0.edits, state0.indels)  # before a row's first pass
    bound = row_bound(loop, queue)  # passes one row may work
    results = Results(queue.x0, jnp.zeros((N,), jnp.int32),
                      jax.tree.map(lambda a: jnp.broadcast_to(a[:1], (N,) + a.shape[1:]), state0.record),
                      () if isinstance(state0.remasks, tuple) else jnp.zeros((N,), jnp.int32),
                      () if isinstance(state0.edits, tuple) else jnp.zeros((N,), jnp.int32),
                      jax.tree.map(lambda a: jnp.zeros((N,), jnp.int32), state0.indels))

    def hand_over(st: SlotState, every: bool = False) -> SlotState:
        """Finished rows' results (`every`: all rows') go to their prompts; their slots then hold none."""
        finished = (st.loop.done | every) & (st.prompt >= 0)
        dest = jnp.where(finished, st.prompt, N)
        rows = Results(st.loop.x, st.loop.nfe, st.loop.record, st.loop.remasks, st.loop.edits, st.loop.indels)
        return st._replace(results=write_rows(st.results, rows, dest), prompt=jnp.where(finished, -1, st.prompt))

    def body(st: SlotState) -> SlotState:
        canvas = dataclasses.replace(queue, **dict(zip(_LAYOUT, st.layout)))
        state = one_pass(denoiser, st.loop, Pass(canvas, st.rule.rule, at0.rule_state0, draws, st.prompt,
                                                 cache=st.rule.cache), rng, loop=loop, special=special)
        # A row that used up its passes (a rule that revokes, at max_passes) stops as it would alone.
        state = state._replace(done=state.done | (state.nfe >= bound))
        if report:  # rows still holding a prompt that are done now finished in this pass: told when there are any,
            # and the pass count every progress.EVERY passes (a host callback costs ~0.1 ms: not every pass)
            finished = jnp.sum(state.done & (st.prompt >= 0), dtype=jnp.int32)
            jax.lax.cond((finished > 0) | (state.passes % progress.EVERY == 0),
                         lambda: jax.debug.callback(progress.report, finished, state.passes), lambda: None)
        st = hand_over(st._replace(loop=state))

        # Free slots take the next prompts, in slot order.
        free = state.done
        rank = jnp.cumsum(free.astype(jnp.int32)) - 1
        takes = free & (st.queued + rank < N)
        j = jnp.where(takes, st.queued + rank, 0)
        layout = tuple(jnp.where(takes.reshape((S,) + (1,) * (a.ndim - 1)), getattr(queue, f)[j], a)
                       for f, a in zip(_LAYOUT, st.layout))
        canvas = dataclasses.replace(queue, **dict(zip(_LAYOUT, layout)))
        rule_state, record, remasks, edits, indels = rows_where(
            takes, fresh, (state.rule_state, state.record, state.remasks, state.edits, state.indels))
        settings = rows_where(takes, take_rows(rule, j), st.rule)
        zero = jnp.zeros_like(state.nfe)
        state = state._replace(
            x=jnp.where(takes[:, None], canvas.x0, state.x),
            block=jnp.where(takes, zero, state.block), step_in_block=jnp.where(takes, zero, state.step_in_block),
            done=state.done & ~takes, nfe=jnp.where(takes, zero, state.nfe),
            cache=settings.cache.refill(denoiser, canvas, state.cache, takes),
            rule_state=rule_state, record=record, remasks=remasks, edits=edits, indels=indels)
        return SlotState(state, layout, settings,
                         jnp.where(takes, j, st.prompt), st.queued + jnp.sum(takes, dtype=jnp.int32), st.results)

    def cond(st: SlotState):
        # A finished row's slot refills in the same iteration while prompts are queued, so all slots done means
        # the queue is empty. Each pass some row works, and a prompt takes at most `bound` working passes.
        return ~jnp.all(st.loop.done) & (st.loop.passes < N * bound)

    st = SlotState(state0, tuple(getattr(canvas0, f) for f in _LAYOUT), rule0, first.astype(jnp.int32),
                   jnp.int32(S), results)
    st = hand_over(jax.lax.while_loop(cond, body, st), every=True)  # (rows cut by the bound on passes too)
    r = st.results
    return LoopOutput(r.x, r.nfe, st.loop.passes, st.loop.full_passes, r.record, r.remasks, r.edits, r.indels)
