"""The whole generation for one batch as one `lax.while_loop`: each iteration is one forward pass of the batch.

    out = decode_loop(denoiser, ids, mask, rng, PerRow(rule, cache), loop=settings, special=special_ids)

The body is the step (`step.denoise_step`: the region's hidden states -> prediction/confidence -> rule ->
commits and remasks; a canvas rule's `step.canvas_step`: accepted positions, the rest re-noised from the pass's
draws, `draws.canvas_draws`) between the pieces `settings` holds: the cache policy (what the pass computes and keeps,
and after the step, from what the pass did, what the next one needs: `forward` then `update`), the recorder (what is
written down), the stop policy (early stop). The loop itself only does the bookkeeping
that every generation shares: per row, a full block moves the row to its next block (or ends it: last block,
or the stop policy) and resets its rule state; NFE counts the passes in which a row was still working.

Everything is static-shaped and per-row state lives in arrays, so the loop has no host round trip. The
rule's and the cache policy's settings are arrays of one value per row (`with_rows`): inputs of the program, not
constants, so a sweep over them runs one compiled program.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.decode.cache import CachePolicy, PassOutcome, PassView
from localleap_jax.decode.canvas import Block, Canvas, Region, rows_take, rows_where
from localleap_jax.decode.draws import PromptDraws, canvas_draws
from localleap_jax.decode.recorder import Recorder
from localleap_jax.decode.step import Scoring, StepResult, canvas_step, denoise_step, predict
from localleap_jax.decode.stop import StopPolicy
from localleap_jax.denoiser import Denoiser, SpecialIds
from localleap_jax.rules import RuleTraits, run_init


class LoopSettings(NamedTuple):
    """The compile-time part of a generation (hashable: part of the compiled program's key)."""

    gen_length: int
    block_length: int
    scoring: Scoring
    cache: CachePolicy  # the cache policy's static part (`policy.static()`); its traced settings are Pass.cache's
    stop: StopPolicy
    recorder: Recorder
    block_grid: bool = False  # blocks on each row's grid from its first real token (block diffusion; canvas.py)
    max_passes: int = 0  # the bound on passes (DecodeConfig.max_passes); 0: one per generated position
    traits: RuleTraits = RuleTraits()  # the rule's static traits (rules.traits_of): region, probes, revokes, ...
    # The rule commits in sub-blocks of this many positions of each block, in order (Fast-dLLM v2); 0: the block.
    sub_block_length: int = 0
    # A block-diffusion model with a logits shift (Fast-dLLM v2): a block's first position is predicted from the
    # position before it, which never sees the block; a row's first pass in a block stores the block before and
    # commits that prediction (the free token) without the rule. (The first block's, from the prompt, costs no NFE.)
    free_tokens: bool = False


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
    indels: Any = ()  # ([B] positions inserted, [B] dropped) per row, for a rule that rewrites (else ())


class LoopOutput(NamedTuple):
    x: Int[Array, "B L"]
    nfe: Int[Array, "B"]
    passes: Int[Array, ""]
    full_passes: Int[Array, ""]
    record: Any
    remasks: Any = ()
    edits: Any = ()
    indels: Any = ()


class PerRow(NamedTuple):
    """The settings with one value per row (inputs of the program: `with_rows`): the rule's and the cache
    policy's."""

    rule: Any
    cache: Any


class Pass(NamedTuple):
    """The per-batch pieces one pass reads besides the state: what the prompts are and how they are decoded."""

    canvas: Canvas  # the rows' layout (a fixed batch: built once; slots: the prompts the slots hold now)
    rule: Any  # the rule with one value per row in every setting
    rule_state0: Any  # a fresh rule state for every row (a row entering a block restarts from it)
    draws: Any = None  # a canvas rule's PromptDraws (decode/draws.py): one entry per prompt
    prompt: Any = None  # [B] each row's entry in `draws`; None: its row in the batch
    cache: Any = None  # the cache policy with one value per row in every traced setting


def one_pass(denoiser: Denoiser, state: LoopState, at: Pass, rng: jax.Array | None, *, loop: LoopSettings,
             special: SpecialIds) -> LoopState:
    """One forward pass of the batch and the bookkeeping after it: the next state. Every row advances through
    its blocks on its own (the cache policy decides per row what the pass computes for it)."""
    canvas, rule, policy = at.canvas, at.rule, at.cache
    B = state.x.shape[0]
    G, T = loop.gen_length, loop.block_length
    region_kind = loop.traits.region  # static: what the rule sees and changes
    block = canvas.block(state.x, state.block)
    draws = None
    if loop.traits.canvas:  # a uniform-noise canvas: a working row starting one takes its first draw
        prompt = jnp.arange(B) if at.prompt is None else at.prompt
        draws = canvas_draws(at.draws, prompt, state.nfe, state.block, state.step_in_block, vocab=denoiser.vocab,
                             length=T)
        first = jnp.where((~state.done & (state.step_in_block == 0))[:, None], draws.initial, block.tokens)
        state = state._replace(x=state.x.at[jnp.arange(B)[:, None], block.idx].set(first))
        block = block._replace(tokens=first)
    region = canvas.region(state.x, block, region_kind)
    free = free_pass(state, block, canvas, special) if loop.free_tokens else None
    starting = state.step_in_block == 0 if free is None else free
    soft = loop.traits.soft_input  # static: the next pass's input comes from this pass's whole generated region
    view = PassView(state.done, starting, state.block, state.step_in_block,
                    loop.recorder.wants_region or region_kind == "generated" or soft,
                    lambda h: predict(denoiser.head(h), loop.scoring._replace(temperature=0.0), special, None)[:2])
    hidden = policy.forward(denoiser, canvas, state.x, block, state.cache, view)
    h_region = hidden.block if region.valid is None else hidden.region
    # the generated region's logits, for a rule that feeds the next pass (the block's are among them)
    region_logits = denoiser.head(hidden.region) if soft else None
    R = loop.sub_block_length or T  # the rule's block: the block, or its current sub-block
    if loop.sub_block_length:
        region, h_region = current_sub_block(block, hidden.block, R, special.mask)
    if draws is not None:
        step = canvas_step(denoiser.head, h_region, region.tokens, state.done, state.step_in_block, rule,
                           state.rule_state, draws=draws)
    else:
        key = None if rng is None else jax.random.fold_in(rng, state.passes)
        step = denoise_step(denoiser.head, h_region, region.tokens, state.done, state.step_in_block, rule,
                            state.rule_state, scoring=loop.scoring, special=special, key=key, gen_length=G,
                            block_length=R, num_blocks=canvas.row_blocks * (T // R), valid=region.valid,
                            held_out=hidden.held_out, traits=loop.traits, idx=region.idx,
                            prompt_length=canvas.prompt_length,
                            logits=None if region_logits is None else rows_take(region_logits,
                                                                                region.idx - canvas.prompt_length))
    if free is not None:
        step = commit_free_tokens(step, free, region.tokens, state.rule_state, forced=len(rule.clause_names) + 1)
    x = state.x.at[jnp.arange(B)[:, None], region.idx].set(step.tokens)
    # What the next pass needs of this one (step.feed: its soft input, read by the policy's update): the rule's weight
    # at every generated position still masked after this pass's writes (a canvas rule's step fills it itself).
    if soft:
        P = canvas.prompt_length
        still = x[:, P:P + region_logits.shape[1]] == special.mask
        step = step._replace(feed=(region_logits, step.soft_weight[:, None] * still.astype(jnp.float32)))

    if loop.traits.canvas:  # a canvas has no masks: it ends when its rule says (its stop, or its last pass)
        block_full = step.finished
        block_now = block._replace(tokens=step.tokens)
    elif loop.sub_block_length:  # the region is a sub-block: the block ends when none of its own is masked
        block_now = block._replace(tokens=rows_take(x, block.idx))
        block_full = ~jnp.any(block_now.tokens == special.mask, axis=1)
    elif region.valid is None:  # the block is the region
        block_full = ~jnp.any(step.tokens == special.mask, axis=1)
        block_now = block._replace(tokens=step.tokens)
    else:  # the block ends when nothing up to its end is masked
        block_full = ~jnp.any((step.tokens == special.mask) & region.valid, axis=1)
        block_now = block._replace(tokens=rows_take(x, block.idx))
    if step.finished is not None:  # a rule that ends its own blocks: on the pass it says so, once no mask is left
        block_full &= step.finished
    last_block = state.block == canvas.row_blocks - 1
    decoded = block.idx >= canvas.prompt_length  # the prompt's tail in a grid row's first block is not decoded
    if loop.free_tokens:  # nor is a free token (a block's first position, after the prompt)
        decoded &= ~((jnp.arange(T) == 0)[None, :] & (block.starts >= canvas.prompt_length)[:, None])
    stop_here, x = loop.stop.update(x, block_now, block_full, last_block, special, decoded)
    done = state.done | (~state.done & block_full & (last_block | stop_here))
    advance = block_full & ~done
    # A row entering a new block starts afresh. (A row with no candidates is done: what its update did is never
    # read.) A rule whose state spans blocks (Saber's threshold history) keeps it through passes in which its row
    # does not work, as the row alone would never have run them.
    # With sub-blocks the rule's block is the sub-block: a filled one restarts it too.
    restart = advance | ~jnp.any(step.tokens == special.mask, axis=1) if loop.sub_block_length else advance
    rule_state = (rows_where(restart, at.rule_state0, step.rule_state) if loop.traits.resets_state
                  else rows_where(step.working, step.rule_state, state.rule_state))
    stepped = step.working if free is None else step.working & ~free  # a free token is not a step of the rule
    counted = step.working if free is None else step.working & ~(free & (state.block == 0))  # the prompt's: no NFE
    record = loop.recorder.update(state.record, denoiser.head, hidden.region, region, step, state.nfe,
                                  canvas.prompt_length, loop.scoring, special)
    # what the cache policy keeps for the next pass, from what this one did
    cache = policy.update(denoiser, hidden.cache, PassOutcome(canvas, state.x, x, block, step, region.idx, done,
                                                              advance))
    return LoopState(
        x=x,
        block=jnp.where(advance, state.block + 1, state.block),
        step_in_block=jnp.where((block_full | done | restart) if loop.sub_block_length else (block_full | done), 0,
                                state.step_in_block + stepped.astype(jnp.int32)),
        done=done,
        nfe=state.nfe + counted.astype(jnp.int32),
        passes=state.passes + 1,
        full_passes=state.full_passes + (jnp.int32(0) if hidden.full is None
                                         else jnp.any(hidden.full).astype(jnp.int32)),
        cache=cache,
        rule_state=rule_state,
        record=record,
        remasks=() if step.remask is None else state.remasks + jnp.sum(step.remask > 0, axis=1, dtype=jnp.int32),
        edits=() if step.edit is None else state.edits + jnp.sum(step.edit > 0, axis=1, dtype=jnp.int32),
        indels=() if not loop.traits.rewrites else tuple(
            n if marks is None else n + jnp.sum(marks, axis=1, dtype=jnp.int32)
            for n, marks in zip(state.indels, (step.insert, step.delete))),
    )


def free_pass(state: LoopState, block: Block, canvas: Canvas, special: SpecialIds) -> Bool[Array, "B"]:
    """Rows whose pass is their block's store pass (a logits shift on a block grid): the block's first position is
    still a mask and the position before it is decoded (a block after the first, or a first one starting on the
    grid, after the prompt)."""
    after_prompt = canvas.first_start == canvas.prompt_length
    return ~state.done & (block.tokens[:, 0] == special.mask) & ((state.block > 0) | after_prompt)


def current_sub_block(block: Block, hidden: Float[Array, "B T D"], S: int, mask_id: int
                      ) -> tuple[Region, Float[Array, "B S D"]]:
    """Each row's first sub-block of S positions that holds a mask (sub-blocks are decoded in order), as the rule's
    region, and the hidden states that predict it."""
    B, T = block.tokens.shape
    masked = (block.tokens == mask_id).reshape(B, T // S, S).any(axis=2)
    at = jnp.argmax(masked, axis=1)[:, None] * S + jnp.arange(S)
    return Region(rows_take(block.idx, at), rows_take(block.tokens, at), None), rows_take(hidden, at)


def commit_free_tokens(step: StepResult, free: Bool[Array, "B"], tokens: Int[Array, "B R"], rule_state, *,
                       forced: int) -> StepResult:
    """In a store pass a row commits its region's first position (its block's first: the free token), with the
    loop's own clause code, and nothing else; its rule did not step (its state is kept)."""
    first = free[:, None] & (jnp.arange(tokens.shape[1]) == 0)
    code = jnp.where(free[:, None], jnp.where(first, jnp.int8(forced), jnp.int8(0)), step.code)
    remask = None if step.remask is None else jnp.where(free[:, None], jnp.int8(0), step.remask)
    edit = None if step.edit is None else jnp.where(free[:, None], jnp.int8(0), step.edit)
    finished = None if step.finished is None else step.finished & ~free
    insert, delete = (None if m is None else m & ~free[:, None] for m in (step.insert, step.delete))
    return step._replace(code=code, tokens=jnp.where(free[:, None], jnp.where(first, step.pred, tokens), step.tokens),
                         rule_state=rows_where(free, rule_state, step.rule_state), remask=remask, edit=edit,
                         finished=finished, insert=insert, delete=delete)


def initial_state(denoiser: Denoiser, canvas: Canvas, rows: PerRow, *, loop: LoopSettings,
                  draws: PromptDraws | None = None) -> tuple[LoopState, Pass]:
    """The state before the first pass, and the pass's fixed pieces, for the rows of `canvas` (`rows`: their
    settings; `draws`: a canvas rule's, per prompt)."""
    B = canvas.batch
    rule = rows.rule
    region = loop.gen_length if loop.traits.region == "generated" else loop.sub_block_length or loop.block_length
    rule_state0 = run_init(rule, B, region, denoiser.vocab)
    zeros = jnp.zeros((B,), jnp.int32)
    state = LoopState(canvas.x0, zeros, zeros, jnp.zeros((B,), bool), zeros, jnp.int32(0), jnp.int32(0),
                      rows.cache.init(denoiser, canvas), rule_state0,
                      loop.recorder.init(B, loop.gen_length, row_bound(loop, canvas) if loop.free_tokens
                                         else loop.max_passes or loop.gen_length,  # store passes: more than G
                                         loop.traits.edits, loop.traits.rewrites),
                      zeros if loop.traits.revokes else (), zeros if loop.traits.edits else (),
                      (zeros, zeros) if loop.traits.rewrites else ())
    return state, Pass(canvas, rule, rule_state0, draws, cache=rows.cache)


def row_bound(loop: LoopSettings, canvas: Canvas) -> int:
    """Passes a row may work: `max_passes`, or as many as it has positions (a rule that only commits commits at
    least one token per working pass, so that always suffices; one that takes commits back runs to the bound)."""
    return loop.max_passes or canvas.length - canvas.prompt_length


def per_row_settings(rows, loop: LoopSettings) -> PerRow:
    """`rows` as PerRow: a bare rule goes with the loop's own cache policy (one without traced settings)."""
    return rows if isinstance(rows, PerRow) else PerRow(rows, loop.cache)


def decode_loop(denoiser: Denoiser, ids: Int[Array, "B P"], mask: Bool[Array, "B P"], rng: jax.Array | None,
                rows: PerRow, draws: PromptDraws | None = None, *, loop: LoopSettings, special: SpecialIds
                ) -> LoopOutput:
    """The whole generation for one batch. `rows`: the rule and the cache policy with one value per row in every
    setting (`with_rows`); `draws`:
    a canvas rule's, one entry per row (decode/draws.py; `rng` is the masked rules' sampling key)."""
    canvas = Canvas.build(ids, mask, gen_length=loop.gen_length, block_length=loop.block_length,
                          mask_id=special.mask, shift=denoiser.shift, grid=loop.block_grid)
    state, at = initial_state(denoiser, canvas, per_row_settings(rows, loop), loop=loop, draws=draws)
    bound = row_bound(loop, canvas)  # every row works in every pass until it is done: a bound on passes

    def body(state: LoopState) -> LoopState:
        return one_pass(denoiser, state, at, rng, loop=loop, special=special)

    def cond(state: LoopState):
        return ~jnp.all(state.done) & (state.passes < bound)

    state = jax.lax.while_loop(cond, body, state)
    return LoopOutput(state.x, state.nfe, state.passes, state.full_passes, state.record, state.remasks, state.edits,
                      state.indels)
