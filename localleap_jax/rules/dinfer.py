"""dInfer's decoders (inclusionAI/dInfer `python/dinfer/decoding/parallel_strategy.py`, `generate_uniform.py`):
its threshold rule under three extensions. `../shared/reference/dinfer-decoders.md` holds the definitions with line
numbers; `oracles/dinfer.py` is the eager transcription the tests compare with.

dInfer's threshold rule is not this project's `threshold`: per block and pass, x0 = the argmax over the whole
vocabulary (the mask id included) and p its probability; the candidates are the masked positions whose x0 is NOT the
mask id; a candidate commits when p >= min(the best candidate's p - 1e-5, threshold) (non-strict: every candidate at
or above the threshold, and always the best with any candidate within 1e-5 of it). Where every masked position's
argmax is the mask id dInfer commits nothing and never ends its block; the loop then commits its most confident
candidate (its contract), which a trained model never reaches. Ids past the tokenizer's vocabulary are never
written (as everywhere in this project); they keep their softmax share.

  credit     the threshold rule on logits fused with a per-block credit: each pass decays the credit (from the
             block's second pass), adds p1 ** boost_gamma to the raw argmax of each still-masked position, and decides
             on logits + credit_alpha * log(1 + credit); it writes the FUSED argmax (`rewrites`).
  hierarchy  per pass: each run of consecutive masked positions (a segment) commits its most confident position(s)
             when above low_threshold, every position above threshold commits, and the block's best always does.
  smooth     the threshold rule with a threshold falling from 1 by threshold_decay a pass (down to `threshold`),
             each pass's input at still-masked positions enriched with the embedding its predecessor's distribution
             expects (`soft_input`), weighted by a weight growing from cont_weight_init to cont_weight; the pass count
             spans blocks (per row).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.rules.base import Decision, RuleBase, Signals, first_clause, per_row, setting
from localleap_jax.rules.registry import register_rule

BAND = 1e-5  # dInfer's: candidates within this of the best commit with it


def mask_wins(s: Signals, logits: Float[Array, "B T V"], pred: Int[Array, "B T"]) -> Bool[Array, "B T"]:
    """Where the argmax of `logits` over the whole vocabulary is the mask id, given `pred`, their argmax without it
    (lowest id on ties, as torch.argmax)."""
    at_mask = logits[..., s.mask_id]
    at_pred = jnp.take_along_axis(logits, pred[..., None], axis=-1)[..., 0]
    return (at_mask > at_pred) | ((at_mask == at_pred) & (s.mask_id < pred))


def threshold_commit(conf: Float[Array, "B T"], candidates: Bool[Array, "B T"], threshold) -> Int[Array, "B T"]:
    """dInfer's `get_transfer_index_threshold`: candidates with conf >= min(best - 1e-5, threshold), as clause codes
    (1 "threshold": at or above it; 2 "best": within the band of the best, below it)."""
    best = jnp.max(jnp.where(candidates, conf, -jnp.inf), axis=1, keepdims=True)
    bound = jnp.minimum(jnp.maximum(best - BAND, -1000.0), per_row(threshold))
    over = candidates & (conf >= per_row(threshold))
    return first_clause(over, candidates & (conf >= bound))


def predict_all(s: Signals, logits: Float[Array, "B T V"]) -> tuple[Int[Array, "B T"], Float[Array, "B T"]]:
    """(argmax over every writable id, the mask id included; its softmax probability) of `logits`."""
    x = jnp.argmax(s.writable(logits), axis=-1).astype(jnp.int32)
    picked = jnp.take_along_axis(logits, x[..., None], axis=-1)[..., 0]
    return x, jnp.exp(picked - jax.nn.logsumexp(logits, axis=-1))


class CreditState(NamedTuple):
    """Each block position's credit, sparse: the ids it credited (one slot per id, `vocab` for an empty slot) and
    their credit. A position gains at most one new id a pass while masked, and a block takes at most its length of
    passes (each commits), so block-length slots hold every id dInfer's dense [T, V] matrix holds (each slot's value
    evolves by the same fp32 operations as that matrix's entry)."""

    ids: Int[Array, "B T K"]
    credit: Float[Array, "B T K"]
    passes: Int[Array, "B"]  # passes made in the current block (the credit decays from the second)


@register_rule("credit")
@struct.dataclass
class Credit(RuleBase):
    """dInfer's CreditThresholdParallelDecoder (`parallel_strategy.py:314-390`; defaults the class's, threshold the
    scripts' 0.9). Per block and pass: from the block's second pass the credit is multiplied by decay_beta; at each
    position still masked, the raw argmax i1 (whole vocabulary) gains p1 ** boost_gamma; the threshold rule (the
    module's) runs on logits + credit_alpha * log(1 + credit), and a commit writes the argmax of those fused logits,
    which can differ from the raw one (`rewrites`). The credit starts at zero in every block (dInfer's is keyed by
    the block's position; its leftover matrices from a generation stopped with masks left are not reproduced).

    State per row: 2 x block_length^2 x 4 bytes (8 KB at block 32) for the sparse credit (`CreditState`), where
    dInfer keeps a dense fp32 block x vocabulary matrix (20.1 MB at block 32, vocabulary 157184). fp32 is needed to
    equal dInfer: bf16's 8 bits of mantissa would move the fused logits by up to ~0.01 and flip close decisions.
    The pass still materialises the fused logits [B, T, V] in fp32, as every rule reading logits does.

    Caches: every mode (the credit is the block's, and each pass sees the block's logits): none, prefix, dual on a
    bidirectional model, block (or none) on a block-diffusion model. Greedy, as everything here is compared: with
    DecodeConfig.temperature > 0 the rule still writes its fused argmax (dInfer would add its Gumbel noise to the
    fused logits)."""

    threshold: float = setting(0.9, low=0.0, high=1.0)
    credit_alpha: float = setting(0.7, low=0.0)
    boost_gamma: float = setting(0.2, low=0.0)
    decay_beta: float = setting(0.8, low=0.0, high=1.0)
    clause_names = ("threshold", "best")
    rewrites: ClassVar[bool] = True

    def init(self, batch, block, vocab):
        return CreditState(jnp.full((batch, block, block), vocab, jnp.int32), jnp.zeros((batch, block, block),
                                                                                     jnp.float32),
                           jnp.zeros((batch,), jnp.int32))

    def update(self, s: Signals, state: CreditState):
        B, T, V = s.logits.shape
        logits = s.logits
        credit = jnp.where((state.passes > 0)[:, None, None], state.credit * per_row(self.decay_beta)[..., None],
                           state.credit)
        top1, p1 = predict_all(s, logits)
        boost = p1 ** per_row(self.boost_gamma)
        gains = s.candidates  # positions masked before this pass (dInfer's mask_index)
        match = state.ids == top1[..., None]
        slot = jnp.where(jnp.any(match, axis=-1), jnp.argmax(match, axis=-1), jnp.argmax(state.ids == V, axis=-1))
        here = (jnp.arange(state.ids.shape[-1]) == slot[..., None]) & gains[..., None]
        ids = jnp.where(here, top1[..., None], state.ids)
        credit = jnp.where(here, credit + boost[..., None], credit)
        # fused = logits + alpha * log(1 + credit): ids without credit add alpha * log(1) = 0 (dropped slots: id V)
        rows, pos = jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None]
        fused = logits.at[rows, pos, ids].add(per_row(self.credit_alpha)[..., None] * jnp.log(credit + 1.0),
                                              mode="drop")
        x0, p = predict_all(s, fused)
        candidates = s.candidates & (x0 != s.mask_id)
        commit = threshold_commit(p, candidates, self.threshold)
        return (Decision(commit, block=jnp.where(commit > 0, x0, s.tokens)),
                CreditState(ids, credit, state.passes + 1))


@register_rule("hierarchy")
@struct.dataclass
class Hierarchy(RuleBase):
    """dInfer's HierarchyDecoder (`parallel_strategy.py:418-498`, `get_transfer_index`; defaults the class's). Per
    pass, with x0 the argmax over the whole vocabulary and p its probability at each masked position, the block's
    masked positions fall into segments (maximal runs of consecutive masked positions); a position commits when
      threshold   p > threshold (strict; None: off)
      segment     it holds its segment's largest p (ties: each) and p > low_threshold (strict; None: no floor)
      top1        it is the block's most confident masked position (first on ties)
    A selected position whose x0 is the mask id writes the mask back (dInfer's no-op): it is not committed here.
    Values the authors use: 0.9 / 0.3 (the scripts), 0.92 / 0.62 (the evaluation guide), 0.9 / 0.4 (the tests).
    Caches: every mode, as credit."""

    threshold: float | None = setting(None, low=0.0, high=1.0, none_ok=True)
    low_threshold: float | None = setting(0.4, low=0.0, high=1.0, none_ok=True)
    clause_names = ("threshold", "segment", "top1")

    def update(self, s: Signals, state):
        masked = s.candidates
        raw_mask = mask_wins(s, s.logits, s.pred)
        at_mask = jnp.exp(s.logits[..., s.mask_id] - jax.nn.logsumexp(s.logits, axis=-1))
        conf = jnp.where(masked, jnp.where(raw_mask, at_mask, s.conf), -jnp.inf)
        T = conf.shape[1]
        starts = masked & ~jnp.pad(masked, ((0, 0), (1, 0)))[:, :-1]
        segment = jnp.where(masked, jnp.cumsum(starts, axis=1) - 1, T)  # T: outside every segment
        seg_max = jax.vmap(lambda c, g: jax.ops.segment_max(c, g, num_segments=T + 1))(conf, segment)
        top = masked & (conf == jnp.take_along_axis(seg_max, segment, axis=1))
        if self.low_threshold is not None:
            top &= conf > per_row(self.low_threshold)
        high = masked & (conf > per_row(self.threshold)) if self.threshold is not None else jnp.zeros_like(masked)
        best = masked & (jnp.arange(T) == jnp.argmax(conf, axis=1)[:, None])
        return first_clause(high, top, best) * ~raw_mask, state


@register_rule("smooth")
@struct.dataclass
class Smooth(RuleBase):
    """dInfer's iteration smoothing (`generate_uniform.py:491-602`, IterSmoothDiffusionLLM + IterationSmooth, with
    `H2Embed` of `modeling_llada2_moe.py:203-282`) over its threshold decoder. With t the row's passes so far (the
    whole generation's, not the block's: the state spans blocks), pass t commits by the module's threshold rule at
    max(1 - t * threshold_decay, threshold), and the next pass's input at every generated position still masked
    after it is E[x] + w_t * softmax(logits_t) @ E, w_t = min(cont_weight_init + t * cont_weight_growth,
    cont_weight) (E: the input embedding table; the loop runs the whole canvas every pass and carries the input:
    `soft_input`). Defaults the class's; threshold the scripts' 0.9.

    Per row, where dInfer's t is shared by a batch's rows; t counts the passes on blocks with masks, where dInfer's
    unrolled calls on a finished block also advance it (blocks of 16 or more, on its whole-canvas runner). Models:
    the bidirectional ones (LLaDA, LLaDA-MoE, Dream: the formula needs only the embedding table; dInfer runs it on
    LLaDA-MoE and LLaDA2's bidirectional path), cache "none"; refused on a block-diffusion model."""

    threshold: float = setting(0.9, low=0.0, high=1.0)
    cont_weight: float = setting(0.3, low=0.0)
    cont_weight_init: float = setting(0.15, low=0.0)
    cont_weight_growth: float = setting(0.02, low=0.0)
    threshold_decay: float = setting(0.02, low=0.0)
    clause_names = ("threshold", "best")
    soft_input: ClassVar[bool] = True
    resets_state: ClassVar[bool] = False

    def init(self, batch, block, vocab):
        return jnp.zeros((batch,), jnp.int32)  # t: the row's passes so far

    def update(self, s: Signals, t):
        tf = t.astype(jnp.float32)
        threshold = jnp.maximum(1.0 - tf * self.threshold_decay, self.threshold)
        weight = jnp.minimum(self.cont_weight_init + tf * self.cont_weight_growth, self.cont_weight)
        candidates = s.candidates & ~mask_wins(s, s.logits, s.pred)
        return Decision(threshold_commit(s.conf, candidates, threshold), soft_weight=weight), t + 1
