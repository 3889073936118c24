"""The published commit rules, eagerly, for one row: the oracle the JAX rules are tested against.

Plain Python over NumPy float64, one position at a time where that reads closest to the source; it
shares no code with `decode.py`, `strategies.py` or the JAX rules on purpose. The exact definitions,
their sources and every deviation from the authors' code are written out in the rules spec
(/work/notes/rules_spec.md, issue #9); each class's docstring gives the rule in one sentence.

Use, per row:

    rule = make("localleap", kappa=0.9, tau=0.75, radius=4).bind(gen_length=256, block_length=32)
    rule.reset()                                     # the row enters a new block
    commits = rule.select(step_in_block, candidates, probs, pred, conf)   # {position: clause}

Positions are block positions (0..T-1). `probs` [T, V] is each position's distribution (only the
rules that read whole distributions need it: margin and entropy when not given directly, KLASS);
`pred` and `conf` are [T]. `margin=` / `entropy=` may be passed directly instead of `probs` (the
boundary-case table does, to use exact dyadic values). A stateful rule's `select` is one pass of the
row: call it once per pass the row works, and `reset()` when the row enters a block.

Common to all rules (the loop contract): commits are candidates, and a row that has candidates commits
at least one: where the rule chooses none, its most confident candidate (highest conf, lowest position
on ties) commits under the clause "forced" (the loop's, not the rule's). Rules that rank by confidence (low_confidence, threshold,
localleap, factor, stable) always commit that candidate as "top1" themselves; rules that rank by another
signal (eb, margin, entropy) or commit only what is ready (klass) do not, as in their published forms.
Ranking ties go to the lowest position. Clause names: the first clause, in each rule's `clauses` order,
that allows the commit.
"""

from __future__ import annotations

import copy
import math
from typing import Iterable, Sequence

import numpy as np

FORCED = "forced"  # the clause of a commit only the loop contract made (the rule chose none); as in the traces


def schedule_quota(step_in_block: int, *, steps: int | None, gen_length: int, block_length: int) -> int:
    """LLaDA's get_num_transfer_tokens at this step: block_length spread over steps per block, remainder first.

    Used as written for every step >= 0 (KLASS's fallback can run past the block's scheduled steps).
    """
    num_blocks = gen_length // block_length
    per_block = (gen_length if steps is None else steps) // num_blocks
    base, rem = divmod(block_length, per_block)
    return base + (1 if step_in_block < rem else 0)


def entropy_of(p: np.ndarray) -> np.ndarray:
    """-sum p log p over the last axis, with 0 log 0 = 0 (nats)."""
    p = np.asarray(p, np.float64)
    logp = np.log(np.where(p > 0, p, 1.0))
    return -np.sum(np.where(p > 0, p * logp, 0.0), axis=-1)


def margin_of(p: np.ndarray) -> np.ndarray:
    """Largest minus second-largest entry of each distribution (last axis)."""
    top2 = np.sort(np.asarray(p, np.float64), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


class Rule:
    """One rule's settings and (for stateful rules) one row's state."""

    name: str = ""
    clauses: tuple[str, ...] = ()
    commits_top1 = True  # the most confident candidate always commits (rules that rank by confidence)
    uses_schedule = False  # needs gen_length / block_length (LLaDA's quota)
    reads: tuple[str, ...] = ()  # signals beyond pred/conf it reads: "margin", "entropy", "probs"
    defaults: dict = {}

    def __init__(self, **settings):
        unknown = set(settings) - set(self.defaults)
        if unknown:
            raise ValueError(f"{self.name} has no setting {', '.join(sorted(unknown))}; "
                             f"its settings are {', '.join(self.defaults) or 'none'}")
        self.settings = {**self.defaults, **settings}
        for k, v in self.settings.items():
            setattr(self, k, v)
        self.gen_length = self.block_length = None
        self.validate()
        self.reset()

    def __repr__(self):
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"

    # -- settings
    def validate(self) -> "Rule":
        """Raise ValueError for settings the rule cannot run with."""
        return self

    def bind(self, *, gen_length: int, block_length: int) -> "Rule":
        """Attach the decode shape (LLaDA's schedule needs it) and check settings that depend on it."""
        self.gen_length, self.block_length = gen_length, block_length
        steps = self.settings.get("steps")
        if steps is not None:
            num_blocks = gen_length // block_length
            if steps % num_blocks:
                raise ValueError(f"steps={steps} is not a multiple of the number of blocks ({num_blocks})")
            if steps > gen_length:
                raise ValueError(f"steps={steps} > gen_length={gen_length}: some steps would commit nothing")
        return self

    def quota(self, step_in_block: int) -> int:
        if self.gen_length is None:
            raise ValueError(f"{self.name} follows LLaDA's schedule: call bind(gen_length=..., block_length=...)")
        return schedule_quota(step_in_block, steps=self.settings.get("steps"), gen_length=self.gen_length,
                              block_length=self.block_length)

    # -- state
    def reset(self) -> None:
        """The row enters a new block (stateless rules keep nothing)."""

    # -- one pass
    def select(self, step_in_block: int, candidates, probs, pred, conf, *, margin=None, entropy=None
               ) -> dict[int, str]:
        """{block position: clause} committed this pass (one row)."""
        cand = _positions(candidates, len(conf))
        conf = [float(c) for c in np.asarray(conf, np.float64)]
        if not cand:
            return {}
        top1 = min(cand, key=lambda i: (-conf[i], i))
        chosen = self._select(step_in_block, cand, probs, pred, conf, margin, entropy, top1)
        out = {top1: "top1"} if self.commits_top1 else {}
        for i in sorted(chosen):
            out.setdefault(i, chosen[i])
        if not out:  # the loop contract: at least one commit per working row
            out = {top1: FORCED}
        assert set(out) <= set(cand), (self.name, out, cand)
        return out

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1) -> dict[int, str]:
        raise NotImplementedError


def _positions(candidates, T: int) -> list[int]:
    """Candidates as sorted block positions, from a bool mask [T] or an iterable of positions."""
    a = np.asarray(candidates)
    if a.dtype == bool:
        if a.shape != (T,):
            raise ValueError(f"candidate mask has shape {a.shape}, expected ({T},)")
        return [int(i) for i in np.flatnonzero(a)]
    return sorted({int(i) for i in a.reshape(-1)})


def _by(values: Sequence[float], cand: Iterable[int], descending: bool) -> list[int]:
    """Candidates ranked by value (descending or ascending), lowest position first on ties."""
    sign = -1.0 if descending else 1.0
    return sorted(cand, key=lambda i: (sign * values[i], i))


def _signal(given, probs, fn, name):
    if given is not None:
        return [float(v) for v in np.asarray(given, np.float64)]
    if probs is None:
        raise ValueError(f"{name} needs probs (or {name}= given directly)")
    return [float(v) for v in fn(np.asarray(probs, np.float64))]


def _check_steps(rule: Rule) -> None:
    s = rule.settings["steps"]
    if s is not None and (not _is_int(s) or s <= 0):
        raise ValueError(f"steps={s!r} must be a positive integer or None")


# ------------------------------------------------------------------------------------------------


class LowConfidence(Rule):
    """LLaDA: the quota(s) most confident candidates, quota from LLaDA's per-block schedule
    (ML-GSAI/LLaDA generate.py, get_num_transfer_tokens; steps=None means gen_length)."""

    name, clauses, uses_schedule = "low_confidence", ("top1", "schedule"), True
    defaults = {"steps": None}

    def validate(self):
        _check_steps(self)
        return self

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        return {i: "schedule" for i in _by(conf, cand, True)[:self.quota(step)]}


class Dynamic(Rule):
    """SDAR's low_confidence_dynamic (JetAstra/SDAR generate.py): every candidate with conf > threshold (strict)
    when there are at least the schedule's quota of them, else the quota most confident. Candidates only
    (SDAR's top-k over the whole block may pick decoded positions when fewer masks remain than the quota)."""

    name, clauses, uses_schedule = "dynamic", ("threshold", "schedule"), True
    commits_top1 = False  # the schedule's quota (>= 1) commits, or at least that many over the threshold
    defaults = {"threshold": 0.85, "steps": None}

    def validate(self):
        _check_steps(self)
        if not (_is_real(self.threshold) and 0.0 <= self.threshold <= 1.0):
            raise ValueError(f"threshold={self.threshold!r} must be in [0, 1]")
        return self

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        quota = self.quota(step)
        over = [i for i in cand if conf[i] > self.threshold]
        if len(over) >= quota:
            return {i: "threshold" for i in over}
        return {i: "schedule" for i in _by(conf, cand, True)[:quota]}


class Threshold(Rule):
    """Fast-dLLM: the most confident candidate, plus every candidate with conf >= kappa
    (NVlabs/Fast-dLLM llada/generate.py, get_transfer_index with threshold)."""

    name, clauses = "threshold", ("top1", "threshold")
    defaults = {"kappa": 0.9}

    def validate(self):
        if not (_is_real(self.kappa) and 0.0 < self.kappa <= 1.0):
            raise ValueError(f"kappa={self.kappa!r} must lie in (0, 1]")
        return self

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        return {i: "threshold" for i in cand if conf[i] >= self.kappa}


class LocalLeap(Rule):
    """LocalLeap: threshold, plus every candidate with conf >= tau within `radius` block positions of an
    anchor (a candidate with conf >= kappa) (this project; DESIGN.md, "The LocalLeap commit rule")."""

    name, clauses = "localleap", ("top1", "anchor", "relaxed")
    defaults = {"kappa": 0.9, "tau": 0.75, "radius": 4}

    def validate(self):
        for k in ("kappa", "tau"):
            v = getattr(self, k)
            if not (_is_real(v) and 0.0 < v <= 1.0):
                raise ValueError(f"{k}={v!r} must lie in (0, 1]")
        if self.tau > self.kappa:
            raise ValueError(f"tau={self.tau} > kappa={self.kappa}: the relaxed threshold must not be stricter")
        if not (_is_int(self.radius) and self.radius >= 0):
            raise ValueError(f"radius={self.radius!r} must be an integer >= 0")
        return self

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        anchors = [j for j in cand if conf[j] >= self.kappa]
        out = {j: "anchor" for j in anchors}
        for i in cand:
            if i not in out and conf[i] >= self.tau and any(abs(i - j) <= self.radius for j in anchors):
                out[i] = "relaxed"
        return out


class Factor(Rule):
    """Fast-dLLM's factor rule as its code runs (NVlabs/Fast-dLLM llada/generate.py, get_transfer_index_dynamic):
    thresholds 1 - f / (n + 1) for n = 1..len (the first replaced by -1), the sorted confidences walked until the
    first below its threshold; that index top_i is bumped by one when it is 0 or the last, and the top top_i
    commit (so a failing last candidate commits, and two candidates always both do). `textbook=1`: no bump,
    the longest passing prefix (at least one)."""

    name, clauses = "factor", ("top1", "factor")
    defaults = {"f": 1.0, "textbook": 0}

    def validate(self):
        if not (_is_real(self.f) and self.f > 0):
            raise ValueError(f"f={self.f!r} must be > 0")
        if self.textbook not in (0, 1):
            raise ValueError(f"textbook={self.textbook!r} must be 0 or 1")
        return self

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        ranked = _by(conf, cand, True)
        threshs = [1.0 - self.f / (n + 1) for n in range(1, len(ranked) + 1)]
        threshs[0] = -1.0  # always transfer at least one token
        if self.textbook:  # the longest passing prefix
            n = 1
            while n < len(ranked) and conf[ranked[n]] >= threshs[n]:
                n += 1
            return {i: "factor" for i in ranked[:n]}
        for top_i in range(len(threshs)):  # the authors' loop, as written
            if conf[ranked[top_i]] < threshs[top_i]:
                break
        if top_i == 0 or top_i == len(threshs) - 1:
            top_i += 1
        return {i: "factor" for i in ranked[:top_i]}


class EntropyBounded(Rule):
    """EB-Sampler (arXiv 2505.24857): sort candidates by entropy ascending and commit the largest prefix
    whose entropy sum minus its largest entropy is <= gamma."""

    name, clauses, reads, commits_top1 = "eb", ("entropy_budget",), ("entropy",), False
    defaults = {"gamma": 0.01}

    def validate(self):
        if not (_is_real(self.gamma) and self.gamma >= 0):
            raise ValueError(f"gamma={self.gamma!r} must be >= 0")
        return self

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        h = _signal(entropy, probs, entropy_of, "entropy")
        ranked = _by(h, cand, False)
        n, before = 1, 0.0  # `before`: sum of the entropies ranked ahead of rank n (the prefix minus its max)
        for r in range(2, len(ranked) + 1):
            before += h[ranked[r - 2]]
            if before <= self.gamma:
                n = r
            else:
                break
        return {i: "entropy_budget" for i in ranked[:n]}


class Margin(Rule):
    """Top-k margin (Kim et al., arXiv 2502.06768; Dream's topk_margin): the quota(s) candidates with the
    largest top-1 minus top-2 probability, quota from LLaDA's schedule."""

    name, clauses, uses_schedule, reads, commits_top1 = "margin", ("schedule",), True, ("margin",), False
    defaults = {"steps": None}
    _descending, _signal_name = True, "margin"

    def validate(self):
        _check_steps(self)
        return self

    def _values(self, probs, margin, entropy):
        return _signal(margin, probs, margin_of, "margin")

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        ranked = _by(self._values(probs, margin, entropy), cand, self._descending)
        return {i: "schedule" for i in ranked[:self.quota(step)]}


class Entropy(Margin):
    """Negative entropy (Dream's `entropy` alg): the quota(s) candidates of lowest entropy, quota from
    LLaDA's schedule."""

    name, reads = "entropy", ("entropy",)
    _descending = False

    def _values(self, probs, margin, entropy):
        return _signal(entropy, probs, entropy_of, "entropy")


class Klass(Rule):
    """KLASS (arXiv 2511.05664; shkim0116/KLASS src/model/llada_klass.py, stable_confident_decode): commit
    the candidates with conf > tau_c whose KL(this pass || previous pass) stayed < tau_kl for the last
    `history` passes of this block; none ready -> LLaDA's schedule by confidence.

    Per-block reset (no previous distribution at a block's first pass) and the exact KL (no eps): the
    deviations from the authors' code are listed in the rules spec. As in their code, only the ready
    candidates commit when any is ready (no extra most-confident one).
    """

    name, clauses, uses_schedule, reads, commits_top1 = "klass", ("stable_kl", "fallback"), True, ("probs",), False
    defaults = {"tau_c": 0.9, "tau_kl": 0.01, "history": 2, "steps": None}

    def validate(self):
        if not (_is_real(self.tau_c) and 0.0 <= self.tau_c < 1.0):
            raise ValueError(f"tau_c={self.tau_c!r} must lie in [0, 1)")
        if not (_is_real(self.tau_kl) and self.tau_kl > 0):
            raise ValueError(f"tau_kl={self.tau_kl!r} must be > 0")
        if not (_is_int(self.history) and self.history >= 1):
            raise ValueError(f"history={self.history!r} must be an integer >= 1")
        _check_steps(self)
        return self

    def reset(self):
        self.prev = None  # [T, V] log-probabilities of the previous pass in this block
        self.run = None  # [T] consecutive passes with KL < tau_kl

    @staticmethod
    def kl(p: np.ndarray, logp: np.ndarray, prev_logp: np.ndarray) -> np.ndarray:
        """KL(p || prev) per position; entries with p = 0 contribute 0, p > 0 where prev = 0 gives +inf."""
        with np.errstate(invalid="ignore"):
            terms = np.where(p > 0, p * (logp - prev_logp), 0.0)
        return terms.sum(axis=-1)

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        if probs is None:
            raise ValueError("klass reads whole distributions: pass probs [T, V]")
        p = np.asarray(probs, np.float64)
        with np.errstate(divide="ignore"):
            logp = np.log(p)  # -inf where p = 0
        if self.prev is None:
            self.run = np.zeros(len(conf), np.int64)
        else:
            below = self.kl(p, logp, self.prev) < self.tau_kl
            self.run = np.where(below, self.run + 1, 0)
        self.prev = logp
        ready = [i for i in cand if conf[i] > self.tau_c and self.run[i] >= self.history]
        if ready:
            return {i: "stable_kl" for i in ready}
        return {i: "fallback" for i in _by(conf, cand, True)[:self.quota(step)]}


class Stable(Rule):
    """This project's worked example of a stateful rule: commit a candidate once its prediction has been
    the same for k consecutive passes of the row in this block and its confidence is >= c_min."""

    name, clauses = "stable", ("top1", "stable")
    defaults = {"k": 2, "c_min": 0.5}

    def validate(self):
        if not (_is_int(self.k) and self.k >= 1):
            raise ValueError(f"k={self.k!r} must be an integer >= 1")
        if not (_is_real(self.c_min) and 0.0 <= self.c_min <= 1.0):
            raise ValueError(f"c_min={self.c_min!r} must lie in [0, 1]")
        return self

    def reset(self):
        self.last = None  # [T] previous prediction per block position
        self.run = None  # [T] passes the prediction has stayed the same

    def _select(self, step, cand, probs, pred, conf, margin, entropy, top1):
        pred = np.asarray(pred, np.int64)
        if self.last is None:
            self.run = np.ones(len(pred), np.int64)
        else:
            self.run = np.where(pred == self.last, self.run + 1, 1)
        self.last = pred.copy()
        return {i: "stable" for i in cand if self.run[i] >= self.k and conf[i] >= self.c_min}


RULES: dict[str, type[Rule]] = {r.name: r for r in (LowConfidence, Dynamic, Threshold, LocalLeap, Factor,
                                                     EntropyBounded, Margin, Entropy, Klass, Stable)}


def make(name: str, **settings) -> Rule:
    """A fresh rule object (its own state) by name; unknown names and settings raise ValueError."""
    try:
        cls = RULES[name]
    except KeyError:
        raise ValueError(f"unknown rule {name!r}; choose from {', '.join(sorted(RULES))}") from None
    return cls(**settings)


def fresh(rule: Rule) -> Rule:
    """An independent copy with the same settings and binding (one per row), its state reset."""
    out = copy.deepcopy(rule)
    out.reset()
    return out
