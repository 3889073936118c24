"""One denoising step, apart from the loop's bookkeeping: hidden states of the rule's region -> LM head ->
prediction and confidence -> the rule -> commits (and remasks).

`predict` turns logits into a prediction, its confidence and the scored distribution; `denoise_step` runs
the rule on them and keeps the rule contract (only candidates commit; a working row commits at least its
most confident candidate unless it remasks; only positions that hold a token are remasked), so no rule has to.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.denoiser import SpecialIds
from localleap_jax.rules import Decision, DecodeError, RuleTraits, Signals, most_confident, run_update
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
    working: Bool[Array, "B"]  # rows that had a candidate this step
    remask: Int[Array, "B T"] | None = None  # int8 remask codes (k: remask_names[k - 1]); None: the rule never does


def denoise_step(head: Callable[[Array], Array], hidden: Float[Array, "B T D"], tokens: Int[Array, "B T"],
                 done: Bool[Array, "B"], step_in_block: Int[Array, "B"], rule, rule_state, *, scoring: Scoring,
                 special: SpecialIds, key: jax.Array | None, gen_length: int, block_length: int,
                 num_blocks: Int[Array, "B"] | int | None = None, valid: Bool[Array, "B T"] | None = None,
                 held_out: Float[Array, "B T D"] | None = None, traits: RuleTraits = RuleTraits()) -> StepResult:
    """One step on each row's region (its current block, or the generated region up to the block's end, `valid`):
    `hidden` are the hidden states that predict it, `tokens` what it holds. Rows that are `done` have no
    candidates. `num_blocks`: the blocks each row decodes (the schedule's steps per block are a rule's `steps`
    over it; default gen_length // block_length). `held_out`: hidden states of the block's probe copy (a rule
    with probes). `traits`: the rule's static traits (whether it takes commits back)."""
    pred, conf, scored = predict(head(hidden), scoring, special, key)
    is_mask = tokens == special.mask
    in_region = ~done[:, None] if valid is None else valid & ~done[:, None]
    candidates = is_mask & in_region
    working = jnp.any(candidates, axis=1)
    held_out_logits = None if held_out is None else predict(head(held_out), scoring._replace(temperature=0.0),
                                                            special, None)[2]
    signals = Signals(logits=scored, pred=pred, conf=conf, candidates=candidates, step=step_in_block,
                      gen_length=gen_length, block_length=block_length, num_blocks=num_blocks, tokens=tokens,
                      valid=valid, mask_id=special.mask, held_out_logits=held_out_logits)
    # The rule's code runs here, while the loop is traced: a failure in it is one line naming the rule and its line.
    decision, rule_state = run_update(rule, signals, rule_state)
    forced = len(rule.clause_names) + 1
    if not isinstance(decision, Decision):  # a rule that only commits: nothing of the remask path is traced
        if traits.revokes:
            raise DecodeError(f"rule {label(rule)} declares remask_names but returned {type(decision).__name__}: a "
                              "rule that takes commits back returns ll.rules.Decision(commit, remask)")
        checked(rule, "commit", decision, candidates.shape)
        code = keep_contract(decision, candidates, conf, forced=forced)
        return StepResult(pred, conf, code, jnp.where(code > 0, pred, tokens), rule_state, working)
    code, remask = apply_decision(decision, rule, traits, candidates, in_region, pred, tokens, conf, special.mask,
                                  forced)
    new = jnp.where(remask > 0, special.mask, jnp.where(code > 0, pred, tokens))
    return StepResult(pred, conf, code, new, rule_state, working, remask)


def checked(rule, what: str, value, shape: tuple[int, ...]):
    """A rule's commit (or remask) as returned, refused in one line naming the rule when it is not an array of the
    region's shape holding bool or integer codes (checked while tracing: static shapes and dtypes, no cost)."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        hint = " (a rule that takes commits back returns ll.rules.Decision(commit, remask))" if isinstance(
            value, tuple) else ""
        raise DecodeError(f"rule {label(rule)} returned {type(value).__name__} as its {what}; expected an array "
                          f"{tuple(shape)} of bool or int8 clause codes{hint}")
    if tuple(value.shape) != tuple(shape):
        raise DecodeError(f"rule {label(rule)} returned a {what} of shape {tuple(value.shape)}; expected "
                          f"{tuple(shape)} (one value per position of each row's region)")
    if not (jnp.issubdtype(value.dtype, jnp.bool_) or jnp.issubdtype(value.dtype, jnp.integer)):
        raise DecodeError(f"rule {label(rule)} returned a {what} of dtype {value.dtype}; expected bool or int8 "
                          "clause codes (0: none, k: clause_names[k - 1])")
    return value


def apply_decision(decision: Decision, rule, traits: RuleTraits, candidates: Bool[Array, "B T"],
                   in_region: Bool[Array, "B T"], pred: Int[Array, "B T"], tokens: Int[Array, "B T"],
                   conf: Float[Array, "B T"], mask_id: int, forced: int) -> tuple[Int[Array, "B T"], Int[Array, "B T"]]:
    """(commit codes, remask codes) of a rule that revokes, kept to the contract: commits first (candidates only),
    then remasks of what holds a token after them (decoded before this pass or just committed; never the prompt,
    never outside the region); a working row that neither commits nor remasks commits its most confident
    candidate, as a rule that only commits always does. (Never traced for a rule that only commits.)"""
    if not traits.revokes:
        raise DecodeError(f"rule {label(rule)} returned Decision(commit, remask) but declares no "
                          "remask_names: a rule that takes commits back names its remask clauses (remask_names = (...))")
    checked(rule, "commit", decision.commit, candidates.shape)
    checked(rule, "remask", decision.remask, candidates.shape)
    code = jnp.where(candidates, decision.commit.astype(jnp.int8), jnp.int8(0))
    after = jnp.where(code > 0, pred, tokens)
    remask = jnp.where((after != mask_id) & in_region, decision.remask.astype(jnp.int8), jnp.int8(0))
    idle = ~jnp.any(code > 0, axis=1, keepdims=True) & ~jnp.any(remask > 0, axis=1, keepdims=True)
    return jnp.where(idle & most_confident(conf, candidates), jnp.int8(forced), code), remask


def keep_contract(code: Array, candidates: Bool[Array, "B T"], conf: Float[Array, "B T"], forced: int
                  ) -> Int[Array, "B T"]:
    """A rule's commits as int8 codes, kept to the contract: only candidates commit, and a row where the rule
    chose none commits its most confident candidate (with code `forced`: a commit only the loop made)."""
    code = jnp.where(candidates, code.astype(jnp.int8), jnp.int8(0))
    chose_none = ~jnp.any(code > 0, axis=1, keepdims=True)
    return jnp.where(chose_none & most_confident(conf, candidates), jnp.int8(forced), code)
