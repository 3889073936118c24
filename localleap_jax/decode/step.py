"""One denoising step, apart from the loop's bookkeeping: hidden states of the rule's region -> LM head ->
prediction and confidence -> the rule -> commits (and remasks, edits). A canvas rule's pass (a uniform-noise
canvas, no masks) is `canvas_step`: accepted positions and the re-noised rest.

`predict` turns logits into a prediction, its confidence and the scored distribution; `denoise_step` runs
the rule on them and keeps the rule contract (only candidates commit; a working row commits at least its
most confident candidate unless it remasks; only positions that hold a generated token are remasked or edited,
an edit only where the prediction differs), so no rule has to.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.decode.draws import Draws
from localleap_jax.denoiser import SpecialIds
from localleap_jax.rules import (CanvasDecision, CanvasSignals, Decision, DecodeError, RuleTraits, Signals,
                                 most_confident, run_temperature, run_update)
from localleap_jax.rules.failures import label


class Scoring(NamedTuple):
    """How logits become predictions (compile-time settings of a DecodeConfig)."""

    temperature: float = 0.0  # 0: argmax; > 0: a Gumbel-max sample from softmax(logits / temperature)
    logits_eos_inf: bool = False  # LLaDA switch: never predict EOS
    confidence_eos_eot_inf: bool = False  # LLaDA switch: EOS/EOT predictions get confidence 0 (commit last)


def predict(logits: Float[Array, "B T V"], scoring: Scoring, ids: SpecialIds, key: jax.Array | None
            ) -> tuple[Int[Array, "B T"], Float[Array, "B T"], Float[Array, "B T V"]]:
    """Prediction, its confidence (softmax probability) and the scored logits, all fp32.

    The scored logits are the distribution every confidence-like signal comes from: LLaDA's
    switches put EOS (and EOT) at -inf there. The mask token and ids the tokenizer cannot decode are
    never predicted, but keep their (tiny, in a trained model) share of the softmax, as in the
    published code, which would write them into the canvas."""
    logits = logits.astype(jnp.float32)
    if scoring.logits_eos_inf:
        logits = logits.at[..., ids.eos].set(-jnp.inf)
    # Never predict the mask token (a committed mask would stay a hole) or an id the tokenizer cannot decode.
    vocab = jnp.arange(logits.shape[-1])
    allowed = vocab != ids.mask
    if ids.vocab_limit is not None and ids.vocab_limit < logits.shape[-1]:
        allowed &= vocab < ids.vocab_limit
    choosable = jnp.where(allowed, logits, -jnp.inf)
    if scoring.temperature > 0 and key is not None:
        pred = jax.random.categorical(key, choosable / scoring.temperature, axis=-1)  # Gumbel-max
    else:
        pred = jnp.argmax(choosable, axis=-1)
    scored = logits
    if scoring.confidence_eos_eot_inf:
        scored = scored.at[..., ids.eos].set(-jnp.inf)
        if ids.eot is not None:
            scored = scored.at[..., ids.eot].set(-jnp.inf)
    picked = jnp.take_along_axis(scored, pred[..., None], axis=-1)[..., 0]
    # A prediction the switch put at -inf (EOS/EOT, or a row with nothing else finite) has confidence 0, not the
    # NaN that exp(-inf - -inf) gives: a NaN would rank first in every argmax and commit first instead of last.
    conf = jnp.where(jnp.isneginf(picked), 0.0, jnp.exp(picked - jax.nn.logsumexp(scored, axis=-1)))
    return pred.astype(jnp.int32), conf, scored


class StepResult(NamedTuple):
    pred: Int[Array, "B T"]  # the prediction at every position of the region
    conf: Float[Array, "B T"]  # its confidence
    code: Int[Array, "B T"]  # int8 commit codes: 0 none, k committed by clause k (the rule's, then the loop's forced one)
    tokens: Int[Array, "B T"]  # the region after this step's commits and remasks
    rule_state: Any
    working: Bool[Array, "B"]  # rows that had a candidate this step (ends_blocks: rows in a block not yet finished)
    remask: Int[Array, "B T"] | None = None  # int8 remask codes (k: remask_names[k - 1]); None: the rule never does
    edit: Int[Array, "B T"] | None = None  # int8 edit codes (k: edit_names[k - 1]), each a token replaced; None: never
    finished: Bool[Array, "B"] | None = None  # rows whose block the rule finished this pass (ends_blocks); None: never
    insert: Bool[Array, "B T"] | None = None  # where the rule inserted a position (rewrites); None: never
    delete: Bool[Array, "B T"] | None = None  # where the rule dropped a position (rewrites); None: never
    soft_weight: Float[Array, "B"] | None = None  # the weight of the next pass's input embedding (soft_input)
    # What the next pass's soft input is made of (logits [B, R, V], weight [B, R]): a canvas rule's pass gives its
    # temperature-scaled logits (self-conditioning); the loop fills it in for a rule with soft_input. None: nothing.
    feed: tuple | None = None


def denoise_step(head: Callable[[Array], Array], hidden: Float[Array, "B T D"], tokens: Int[Array, "B T"],
                 done: Bool[Array, "B"], step_in_block: Int[Array, "B"], rule, rule_state, *, scoring: Scoring,
                 special: SpecialIds, key: jax.Array | None, gen_length: int, block_length: int,
                 num_blocks: Int[Array, "B"] | int | None = None, valid: Bool[Array, "B T"] | None = None,
                 held_out: Float[Array, "B T D"] | None = None, traits: RuleTraits = RuleTraits(),
                 idx: Int[Array, "B T"] | None = None, prompt_length: int = 0,
                 logits: Float[Array, "B T V"] | None = None) -> StepResult:
    """One step on each row's region (its current block, or the generated region up to the block's end, `valid`):
    `hidden` are the hidden states that predict it, `tokens` what it holds. Rows that are `done` have no
    candidates. `num_blocks`: the blocks each row decodes (the schedule's steps per block are a rule's `steps`
    over it; default gen_length // block_length). `held_out`: hidden states of the block's probe copy (a rule
    with probes). `traits`: the rule's static traits (whether it takes commits back, edits, ends its blocks).
    `idx`: the region's canvas indices, those below `prompt_length` being the prompt (never remasked or edited).
    `logits`: the region's logits when the caller has them already (`hidden` is then not read)."""
    pred, conf, scored = predict(head(hidden) if logits is None else logits, scoring, special, key)
    is_mask = tokens == special.mask
    in_region = ~done[:, None] if valid is None else valid & ~done[:, None]
    candidates = is_mask & in_region
    # A row works while it has a mask in its region; under a rule that ends its own blocks, until the rule says its
    # block is finished (its passes after the last mask, JointThreshold's post-edit passes, are work too).
    working = ~done if traits.ends_blocks else jnp.any(candidates, axis=1)
    held_out_logits = None if held_out is None else predict(head(held_out), scoring._replace(temperature=0.0),
                                                            special, None)[2]
    signals = Signals(logits=scored, pred=pred, conf=conf, candidates=candidates, step=step_in_block,
                      gen_length=gen_length, block_length=block_length, num_blocks=num_blocks, tokens=tokens,
                      valid=valid, mask_id=special.mask, held_out_logits=held_out_logits, idx=idx,
                      prompt_length=prompt_length, vocab_limit=special.vocab_limit, delete_id=special.delete,
                      split_id=special.split)
    # The rule's code runs here, while the loop is traced: a failure in it is one line naming the rule and its line.
    decision, rule_state = run_update(rule, signals, rule_state)
    forced = len(rule.clause_names) + 1
    if not isinstance(decision, Decision):  # a rule that only commits: nothing of the remask/edit path is traced
        if traits.decides:
            declared = [t for t, on in (("remask_names", traits.revokes), ("edit_names", traits.edits),
                                        ("ends_blocks", traits.ends_blocks), ("rewrites", traits.rewrites),
                                        ("soft_input", traits.soft_input)) if on]
            form = ("Decision(commit, remask)" if declared == ["remask_names"] else "Decision(commit, " + ", ".join(
                f"{f}=..." for f, on in (("remask", traits.revokes), ("edit", traits.edits),
                                         ("finished", traits.ends_blocks), ("block", traits.rewrites),
                                         ("soft_weight", traits.soft_input)) if on) + ")")
            raise DecodeError(f"rule {label(rule)} declares {' and '.join(declared)} but returned "
                              f"{type(decision).__name__}: a rule that takes commits back, edits, ends its blocks, "
                              f"rewrites them or feeds the next pass returns ll.rules.{form}")
        checked(rule, "commit", decision, candidates.shape)
        code = keep_contract(decision, candidates, conf, forced=forced)
        return StepResult(pred, conf, code, jnp.where(code > 0, pred, tokens), rule_state, working)
    held = in_region & ~signals.prompt  # what the rule may change besides commits
    d = apply_decision(decision, rule, traits, candidates, held, pred, tokens, conf, special.mask, forced)
    if d.block is not None:  # the region the rule writes, and the loop's own commit where the rule made none
        new = jnp.where(d.forced, pred, d.block)
    else:
        new = jnp.where(d.code > 0, pred, tokens)
        if d.edit is not None:
            new = jnp.where(d.edit > 0, pred, new)
    if d.remask is not None:
        new = jnp.where(d.remask > 0, special.mask, new)
    return StepResult(pred, conf, d.code, new, rule_state, working, d.remask, d.edit, d.finished, d.insert, d.delete,
                      d.soft_weight)


def canvas_step(head: Callable[[Array], Array], hidden: Float[Array, "B C D"], tokens: Int[Array, "B C"],
                done: Bool[Array, "B"], step_in_block: Int[Array, "B"], rule, rule_state, *, draws: Draws
                ) -> StepResult:
    """One denoising pass of a canvas rule on each row's canvas (a uniform-noise canvas model: no masks), apart from
    the loop's bookkeeping: logits -> the rule's temperature for the pass -> a sample (the row's key) and the argmax
    -> the rule's CanvasDecision -> the canvas after the pass: the accepted positions take the rule's tokens, the
    others the pass's re-noise draw; a canvas the rule finished keeps the pass's argmax (transformers' output).
    Rows that are `done` keep their canvas. `pred` is the token the rule chose at each position, `conf` its
    probability, `code` the accepted set (the rule's clause codes), `scaled` the temperature-scaled logits (the
    next pass's self-conditioning)."""
    logits = head(hidden).astype(jnp.float32)
    scaled = logits / run_temperature(rule, step_in_block).astype(jnp.float32)[:, None, None]
    argmax = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
    sample = jax.vmap(lambda k, z: jax.random.categorical(k, z, axis=-1))(draws.sample, scaled).astype(jnp.int32)
    signals = CanvasSignals(logits=scaled, sample=sample, argmax=argmax, tokens=tokens, step=step_in_block)
    decision, rule_state = run_update(rule, signals, rule_state)
    if not isinstance(decision, CanvasDecision):
        raise DecodeError(f"rule {label(rule)} is a canvas rule (canvas = True) but returned "
                          f"{type(decision).__name__}; a canvas rule returns ll.rules.CanvasDecision(accept, tokens, "
                          "finished)")
    checked(rule, "accept", decision.accept, tokens.shape)
    checked(rule, "tokens", decision.tokens, tokens.shape)
    if not jnp.issubdtype(decision.tokens.dtype, jnp.integer):
        raise DecodeError(f"rule {label(rule)} returned tokens of dtype {decision.tokens.dtype}; expected token ids")
    finished = checked(rule, "finished", decision.finished, tokens.shape[:1], kinds="bool") & ~done
    working = ~done
    chosen = decision.tokens.astype(jnp.int32)
    code = jnp.where(working[:, None], decision.accept.astype(jnp.int8), jnp.int8(0))
    conf = jnp.exp(jnp.take_along_axis(scaled, chosen[..., None], axis=-1)[..., 0]
                   - jax.nn.logsumexp(scaled, axis=-1))
    after = jnp.where(finished[:, None], argmax, jnp.where(code > 0, chosen, draws.renoise))
    new = jnp.where(working[:, None], after, tokens)
    # the next pass's self-conditioning: this pass's distribution, none where the canvas just finished
    weight = jnp.broadcast_to((~finished)[:, None], tokens.shape).astype(jnp.float32)
    return StepResult(chosen, conf, code, new, rule_state, working, finished=finished, feed=(scaled, weight))


_EXPECTED = {"codes": "of bool or int8 clause codes", "bool": "of bool", "ids": "of token ids",
             "marks": "of bool", "weight": "of floats"}


def checked(rule, what: str, value, shape: tuple[int, ...], kinds: str = "codes"):
    """A rule's commit (or remask, edit, ...) as returned, refused in one line naming the rule when it is not an array
    of the expected shape and dtype (checked while tracing: static shapes and dtypes, no cost). `kinds`: "codes"
    (bool or integer clause codes over the region), "bool" (one per row: a Decision's `finished`), "ids" (token ids
    over the region: `block`), "marks" (bool over the region: `insert`, `delete`), "weight" (one float per row:
    `soft_weight`)."""
    per_row = kinds in ("bool", "weight")
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        hint = " (a rule that takes commits back returns ll.rules.Decision(commit, remask))" if isinstance(
            value, tuple) else ""
        raise DecodeError(f"rule {label(rule)} returned {type(value).__name__} as its {what}; expected an array "
                          f"{tuple(shape)} {_EXPECTED[kinds]}{hint}")
    if tuple(value.shape) != tuple(shape):
        each = "one per row" if per_row else "one value per position of each row's region"
        raise DecodeError(f"rule {label(rule)} returned a {what} of shape {tuple(value.shape)}; expected "
                          f"{tuple(shape)} ({each})")
    dtype = value.dtype
    ok = {"codes": jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.integer),
          "bool": jnp.issubdtype(dtype, jnp.bool_), "marks": jnp.issubdtype(dtype, jnp.bool_),
          "ids": jnp.issubdtype(dtype, jnp.integer), "weight": jnp.issubdtype(dtype, jnp.floating)}[kinds]
    if not ok:
        why = {"codes": "expected bool or int8 clause codes (0: none, k: clause_names[k - 1])",
               "bool": "expected bool (True: the row's block is finished after this pass)",
               "marks": "expected bool (True: the position this pass inserted or dropped)",
               "ids": "expected token ids (the region as the rule writes it)",
               "weight": "expected a float per row (the weight of the next pass's input embedding)"}[kinds]
        raise DecodeError(f"rule {label(rule)} returned a {what} of dtype {dtype}; {why}")
    return value


class Applied(NamedTuple):
    """A Decision kept to the loop's contract (see `apply_decision`); a field the rule never returns is None."""

    code: Int[Array, "B T"]
    remask: Int[Array, "B T"] | None
    edit: Int[Array, "B T"] | None
    finished: Bool[Array, "B"] | None
    block: Int[Array, "B T"] | None
    insert: Bool[Array, "B T"] | None
    delete: Bool[Array, "B T"] | None
    soft_weight: Float[Array, "B"] | None
    forced: Bool[Array, "B T"]  # the loop's own commits (a working row whose rule committed and remasked nothing)


def apply_decision(decision: Decision, rule, traits: RuleTraits, candidates: Bool[Array, "B T"],
                   held: Bool[Array, "B T"], pred: Int[Array, "B T"], tokens: Int[Array, "B T"],
                   conf: Float[Array, "B T"], mask_id: int, forced: int) -> Applied:
    """A rule's Decision kept to the contract: commits first (candidates only), then remasks of what holds a token
    after them (decoded before this pass or just committed), edits of what held a generated token before this pass
    and is not remasked, where the prediction differs from it; remasks and edits only where `held` (inside the
    region, never the prompt). A working row that neither commits nor remasks commits its most confident
    candidate (code `forced`), as a rule that only commits always does. A rule that rewrites: its block where
    `held` or a candidate (elsewhere the tokens as they were), its edit codes where a generated token was held (the
    rule says which it replaced), its inserts and deletes where `held` or a candidate. (Never traced for a rule that
    only commits.)"""
    given = {"remask": decision.remask, "edit": decision.edit, "finished": decision.finished,
             "block": decision.block, "soft_weight": decision.soft_weight}
    for field, trait, declared, why in (
            ("remask", "remask_names", traits.revokes,
             "a rule that takes commits back names its remask clauses (remask_names = (...))"),
            ("edit", "edit_names", traits.edits, "a rule that edits names its edit clauses (edit_names = (...))"),
            ("finished", "ends_blocks", traits.ends_blocks,
             "a rule that says when its block is finished declares ends_blocks = True"),
            ("block", "rewrites", traits.rewrites, "a rule that writes its own region declares rewrites = True"),
            ("soft_weight", "soft_input", traits.soft_input,
             "a rule that feeds the next pass an input embedding declares soft_input = True")):
        if given[field] is not None and not declared:
            raise DecodeError(f"rule {label(rule)} returned Decision(commit, {field}) but declares no {trait}: {why}")
        if given[field] is None and declared:
            raise DecodeError(f"rule {label(rule)} declares {trait} but returned a Decision without {field}: "
                              f"Decision(commit, {field}=...)")
    for field in ("insert", "delete"):
        if getattr(decision, field) is not None and not traits.rewrites:
            raise DecodeError(f"rule {label(rule)} returned Decision(commit, {field}) but declares no rewrites: a rule "
                              "that inserts or drops positions writes its own region (rewrites = True, "
                              "Decision(commit, block=..., insert=..., delete=...))")
    shape = candidates.shape
    checked(rule, "commit", decision.commit, shape)
    code = jnp.where(candidates, decision.commit.astype(jnp.int8), jnp.int8(0))
    remask = edit = finished = block = insert = delete = soft_weight = None
    if traits.rewrites:
        writable = held | candidates
        block = checked(rule, "block", decision.block, shape, kinds="ids")
        block = jnp.where(writable, block.astype(tokens.dtype), tokens)
        insert, delete = (None if getattr(decision, f) is None
                          else writable & checked(rule, f, getattr(decision, f), shape, kinds="marks")
                          for f in ("insert", "delete"))
    if traits.revokes:
        checked(rule, "remask", decision.remask, shape)
        after = jnp.where(code > 0, pred, tokens) if block is None else block
        remask = jnp.where((after != mask_id) & held, decision.remask.astype(jnp.int8), jnp.int8(0))
    if traits.edits:
        checked(rule, "edit", decision.edit, shape)
        replaces = (tokens != mask_id) & held
        if block is None:  # the loop writes the prediction: an edit only where it differs
            replaces &= pred != tokens
        if remask is not None:
            replaces &= remask == 0
        edit = jnp.where(replaces, decision.edit.astype(jnp.int8), jnp.int8(0))
    if traits.ends_blocks:
        finished = checked(rule, "finished", decision.finished, shape[:1], kinds="bool")
    if traits.soft_input:
        soft_weight = checked(rule, "soft_weight", decision.soft_weight, shape[:1], kinds="weight")
    idle = ~jnp.any(code > 0, axis=1, keepdims=True)
    if remask is not None:
        idle &= ~jnp.any(remask > 0, axis=1, keepdims=True)
    forced_here = idle & most_confident(conf, candidates)
    return Applied(jnp.where(forced_here, jnp.int8(forced), code), remask, edit, finished, block, insert, delete,
                   soft_weight, forced_here)


def keep_contract(code: Array, candidates: Bool[Array, "B T"], conf: Float[Array, "B T"], forced: int
                  ) -> Int[Array, "B T"]:
    """A rule's commits as int8 codes, kept to the contract: only candidates commit, and a row where the rule
    chose none commits its most confident candidate (with code `forced`: a commit only the loop made)."""
    code = jnp.where(candidates, code.astype(jnp.int8), jnp.int8(0))
    chose_none = ~jnp.any(code > 0, axis=1, keepdims=True)
    return jnp.where(chose_none & most_confident(conf, candidates), jnp.int8(forced), code)
