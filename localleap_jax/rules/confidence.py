"""Rules that rank by confidence: LLaDA's schedule, SDAR's dynamic threshold, Fast-dLLM's threshold and factor,
LocalLeap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

from localleap_jax.rules.base import (DecodeError, RuleBase, Signals, first_clause, most_confident, per_row, setting,
                                      top_k)
from localleap_jax.rules.registry import register_rule


@register_rule("low_confidence")
@struct.dataclass
class LowConfidence(RuleBase):
    """LLaDA's baseline (`generate.py`, remasking="low_confidence"): commit the k most confident
    candidates, k from LLaDA's fixed per-block schedule for `steps` total steps (None: gen_length,
    one token per step)."""

    steps: int | None = setting(None, int, low=1, none_ok=True)
    clause_names = ("top1", "schedule")

    def update(self, s: Signals, state):
        chosen = top_k(s.conf, s.candidates, s.quota(self.steps))
        return first_clause(most_confident(s.conf, s.candidates), chosen), state


@register_rule("dynamic")
@struct.dataclass
class Dynamic(RuleBase):
    """SDAR's `low_confidence_dynamic` (JetAstra/SDAR `generate.py`): every candidate with confidence strictly
    above `threshold` when there are at least the schedule's quota of them, else the quota's most confident
    (LLaDA's schedule for `steps` in total; per block steps / blocks, SDAR's `denoising_steps`; None: one
    token per step). SDAR's top-k ranks all of the block, so when fewer masks remain than the quota it also
    picks decoded positions and overwrites them with fresh predictions; here only masked positions commit.
    SDAR's `low_confidence_static` is `low_confidence`."""

    threshold: float = setting(0.85, low=0.0, high=1.0)
    steps: int | None = setting(None, int, low=1, none_ok=True)
    clause_names = ("threshold", "schedule")

    def update(self, s: Signals, state):
        quota = s.quota(self.steps)
        over = s.candidates & (s.conf > per_row(self.threshold))
        enough = (jnp.sum(over, axis=-1) >= quota)[:, None]
        return first_clause(over & enough, top_k(s.conf, s.candidates, quota) & ~enough), state


@register_rule("threshold")
@struct.dataclass
class Threshold(RuleBase):
    """Fast-dLLM's parallel decoding (`get_transfer_index` with a threshold): the most confident
    candidate, and every candidate with confidence >= kappa."""

    kappa: float = setting(0.9, low=0.0, high=1.0, low_open=True)
    clause_names = ("top1", "threshold")

    def update(self, s: Signals, state):
        over = s.candidates & (s.conf >= per_row(self.kappa))
        return first_clause(most_confident(s.conf, s.candidates), over), state


def near_any(marks: Bool[Array, "B T"], radius: Int[Array, "B"]) -> Bool[Array, "B T"]:
    """True within `radius` positions (per row, traced) of any marked position.

    The distance to the nearest mark on each side comes from a forward and a backward cumulative
    max of the marks' indices, so no static window is needed."""
    T = marks.shape[-1]
    pos = jnp.arange(T)
    far = 2 * T + 1  # farther than any radius that matters
    before = jax.lax.cummax(jnp.where(marks, pos, -far), axis=1)  # index of the nearest mark at or before i
    after = -jax.lax.cummax(jnp.where(marks, -pos, -3 * far), axis=1, reverse=True)  # at or after i
    r = jnp.minimum(per_row(radius), T)  # a radius past the block reaches the same positions as T
    return (pos - before <= r) | (after - pos <= r)


@register_rule("localleap")
@struct.dataclass
class LocalLeap(RuleBase):
    """LocalLeap (arXiv 2510.07081, Local Determinism Propagation): threshold decoding at kappa, plus
    every candidate with confidence >= tau within `radius` (W) positions of an anchor, a candidate
    with confidence >= kappa."""

    kappa: float = setting(0.9, low=0.0, high=1.0, low_open=True)
    tau: float = setting(0.75, low=0.0, high=1.0, low_open=True)
    radius: int = setting(4, int, low=0)
    clause_names = ("top1", "anchor", "relaxed")

    def validate(self, gen_length=None, block_length=None):
        super().validate()
        if not isinstance(self.tau, jax.core.Tracer) and not isinstance(self.kappa, jax.core.Tracer):
            tau, kappa = np.broadcast_arrays(np.asarray(self.tau, np.float64), np.asarray(self.kappa, np.float64))
            over = np.atleast_1d(tau > kappa)
            if over.any():
                if tau.ndim == 0:
                    raise DecodeError(f"localleap: tau={self.tau} > kappa={self.kappa}: the relaxed threshold must "
                                      "not be stricter than the anchor threshold")
                rows = np.flatnonzero(over)
                shown = ", ".join(f"row {i}: tau {np.atleast_1d(tau)[i]:g} > kappa {np.atleast_1d(kappa)[i]:g}"
                                  for i in rows[:4]) + (", ..." if len(rows) > 4 else "")
                raise DecodeError(f"localleap: the relaxed threshold must not be stricter than the anchor threshold "
                                  f"({shown}); pass tau per row too, e.g. tau=np.minimum(0.75, kappa)")
        return self

    def update(self, s: Signals, state):
        anchors = s.candidates & (s.conf >= per_row(self.kappa))
        relaxed = s.candidates & (s.conf >= per_row(self.tau)) & near_any(anchors, self.radius)
        return first_clause(most_confident(s.conf, s.candidates), anchors, relaxed), state


@register_rule("factor")
@struct.dataclass
class Factor(RuleBase):
    """Fast-dLLM's factor rule, as its `get_transfer_index_dynamic` (NVlabs/Fast-dLLM llada/generate.py) runs it:
    with c_(1) >= c_(2) >= ... the sorted confidences of the n candidates, rank i (1-indexed) passes when
    c_(i) >= 1 - f / (i + 1) (the top one always passes); commit the longest passing prefix, except that when the
    first rank to fail is the last candidate (i = n) all n commit: the authors' `top_i == len(threshs) - 1`
    branch, so two candidates left always both commit. That code produced the published numbers: it is the
    default. `textbook=1` drops the branch (the formula alone: the longest passing prefix)."""

    f: float = setting(1.0, low=0.0, low_open=True)
    textbook: int = setting(0, int, low=0, high=1)
    clause_names = ("top1", "factor")

    def update(self, s: Signals, state):
        T = s.conf.shape[-1]
        ranked = jnp.sort(jnp.where(s.candidates, s.conf, -jnp.inf), axis=-1)[:, ::-1]  # descending
        i = jnp.arange(1, T + 1)  # 1-indexed rank
        passes = (i == 1) | (ranked >= 1.0 - per_row(self.f) / (i + 1))  # the authors' thresholds, as written
        prefix = jnp.sum(jnp.cumprod(passes, axis=-1), axis=-1)  # longest passing prefix
        n_cand = jnp.sum(s.candidates, axis=-1)
        authors = jnp.asarray(self.textbook) == 0
        n = jnp.where(authors & (prefix >= n_cand - 1), n_cand, prefix)  # the first failure is the last: all commit
        chosen = top_k(s.conf, s.candidates, n)
        return first_clause(most_confident(s.conf, s.candidates), chosen), state
