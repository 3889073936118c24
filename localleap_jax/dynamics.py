"""Statistics of decoding dynamics over a `Trace`: the numbers behind the paper's Figures 1 and 2.

Pure NumPy on the arrays of `localleap_jax.trace.Trace` (no JAX, no plotting; the plots live in
localleap_jax/commands/plots.py). Words used in every definition below:

- pass s of row b: the row's own s-th forward pass, 0-based; a row has `passes[b]` of them.
- final token of a position: `trace.token[b, g]`, what the generation ended with there.
- consistent: the prediction at pass s equals the final token (`pred[b, s, g] == token[b, g]`).
- observed: pass s is one of the row's passes and computed a prediction there (pred >= 0, conf
  finite). With a KV cache a pass computes only a window; entries it did not compute say nothing
  about the position, so no statistic reads them.
- decided: the rule committed the position at some pass (`commit_pass >= 0`). Positions filled by
  early stop (`commit_pass == -1`) are left out of every statistic: their final token was written by
  the fill, not taken from a prediction, so "consistent with the final token" there would measure
  the fill rule, not the model (and the decoded text is cut before them anyway).
- scored: still masked when the pass ran (`Trace.masked`: up to and including the commit pass),
  observed and decided. These are the predictions a commit rule chooses among; the statistics of
  Figures 1b and 1c count exactly these.
- thresholds (0.8, 0.9, bin edges) compare in the confidences' own dtype (float32), as the commit
  rules compare kappa: a float32 confidence of 0.9 is ">= 0.9" here as it is for the rule.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from jaxtyping import Bool, Float, Int

from localleap_jax.trace import Trace

PAPER = {"stable_within_25pct": 0.637, "consistent_given_conf_gt_0.8": 0.978}  # LLaDA-8B, arXiv 2510.07081
# What "stable within 25% of the passes" measures under each cache mode (decode/cache.py): which passes predict a
# position. The paper's figure is without a cache, every pass predicting every position.
STABLE_MEANING = {
    "none": "every pass predicts every position, as in the paper (no cache)",
    "prefix": "every pass predicts its block and everything after it, so every masked position at every pass as "
              "without a cache, but through K/V cached once per block: close to, not the same as, the paper's setting",
    "dual": "a pass predicts only its own block, so a position is predicted only once its block opens (after about "
            "k/n of the row's passes for block k of n) and cannot be stable before: not comparable to the paper's "
            "no-cache figure (trace with --cache none for that)",
    "block": "a pass predicts only its own block (a block-diffusion model's exact cache), so a position is predicted "
             "only once its block opens and cannot be stable before: not comparable to the paper's no-cache figure",
}
COMPARABLE_CACHES = ("none", "prefix")  # every masked position predicted at every pass
CONFIDENCE_EDGES = np.arange(11) / 10  # ten bins of width 0.1 (i / 10: each edge is the float closest to it)
FRACTION_EDGES = np.arange(21) / 20  # twenty bins of width 0.05 (Figure 1b's histogram)


# ---------------------------------------------------------------- which entries count


def _pass_index(trace: Trace) -> Int[np.ndarray, "1 S 1"]:
    return np.arange(trace.pred.shape[1])[None, :, None]


def observed(trace: Trace) -> Bool[np.ndarray, "B S G"]:
    """True where pass s is one of row b's passes and computed a prediction at the position."""
    in_row = _pass_index(trace) < np.asarray(trace.passes)[:, None, None]
    return in_row & (trace.pred >= 0) & np.isfinite(trace.conf)


def decided(trace: Trace) -> Bool[np.ndarray, "B G"]:
    """True where the rule committed the position (early-stop fills have commit_pass -1)."""
    return np.asarray(trace.commit_pass) >= 0


def scored(trace: Trace) -> Bool[np.ndarray, "B S G"]:
    """The predictions the statistics count: still masked when pass s ran, observed, decided."""
    return trace.masked & observed(trace) & decided(trace)[:, None, :]


def consistent(trace: Trace) -> Bool[np.ndarray, "B S G"]:
    """True where the prediction at pass s equals the position's final token."""
    return trace.pred == np.asarray(trace.token)[:, None, :]


def in_conf_dtype(conf: np.ndarray, value) -> np.ndarray:
    """`value` in the confidences' own dtype (float32), so a threshold compares as the commit rules compare
    it: float32(0.9) is below the float64 0.9, and a rule's `conf >= 0.9` holds for it."""
    return np.asarray(value, dtype=np.asarray(conf).dtype if np.asarray(conf).dtype.kind == "f" else np.float64)


def confidence_bin(conf: Float[np.ndarray, "..."], edges: Float[np.ndarray, "K1"]) -> Int[np.ndarray, "..."]:
    """Bin k of each confidence: edges[k] <= conf < edges[k + 1], the top edge in the last bin; -1 for NaN.

    Edges compare in the confidences' dtype (see `in_conf_dtype`)."""
    edges = in_conf_dtype(conf, edges)
    k = np.searchsorted(edges, np.nan_to_num(conf, nan=-np.inf), side="right") - 1
    k = np.where(conf == edges[-1], len(edges) - 2, k)
    return np.where(np.isfinite(conf) & (k >= 0) & (k < len(edges) - 1), k, -1)


def concat_traces(traces: Sequence[Trace]) -> Trace:
    """Rows of several traces as one (S padded with the 'not computed' values: pred -1, conf NaN)."""
    if not traces:
        raise ValueError("no traces to concatenate")
    G = {t.token.shape[1] for t in traces}
    if len(G) > 1:
        raise ValueError(f"traces of different gen lengths ({sorted(G)}) cannot be analysed together")
    names = {t.clause_names for t in traces}
    if len(names) > 1:
        raise ValueError(f"traces from rules with different clauses ({sorted(names)}) cannot be analysed together")
    S = max(t.pred.shape[1] for t in traces)

    def pad(a: np.ndarray, value) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, S - a.shape[1]), (0, 0)), constant_values=value)

    return Trace(pred=np.concatenate([pad(t.pred, -1) for t in traces]),
                 conf=np.concatenate([pad(t.conf, np.nan) for t in traces]),
                 committed=np.concatenate([pad(t.committed, False) for t in traces]),
                 clause=np.concatenate([pad(t.clause, 0) for t in traces]),
                 clause_names=traces[0].clause_names,
                 token=np.concatenate([t.token for t in traces]),
                 commit_pass=np.concatenate([t.commit_pass for t in traces]),
                 passes=np.concatenate([t.passes for t in traces]),
                 remask_names=traces[0].remask_names,
                 edit=None if all(t.edit is None for t in traces) else np.concatenate(
                     [pad(np.zeros(t.clause.shape, np.int8) if t.edit is None else t.edit, 0) for t in traces]),
                 edit_names=traces[0].edit_names,
                 indel=None if all(t.indel is None for t in traces) else np.concatenate(
                     [pad(np.zeros(t.clause.shape, np.int8) if t.indel is None else t.indel, 0) for t in traces]))


# ---------------------------------------------------------------- Figure 1b: earliest stable consistency


def stable_step(trace: Trace) -> Int[np.ndarray, "B G"]:
    """The earliest stable-consistency pass of each position; -1 where there is none.

    Among the position's scored passes (still masked, observed), the first pass s such that the
    prediction at s and at every later scored pass equals the final token. Passes that did not
    compute the position are unobserved: they neither break nor start stability. A committed
    position always has one (its commit pass predicts its final token); early-stop fills get -1.
    """
    s = _pass_index(trace)
    counted = scored(trace)
    last_inconsistent = np.max(np.where(counted & ~consistent(trace), s, -1), axis=1, initial=-1)
    S = trace.pred.shape[1]
    first = np.min(np.where(counted & (s > last_inconsistent[:, None, :]), s, S), axis=1, initial=S)
    return np.where(first < S, first, -1)


def stable_fraction(trace: Trace) -> Float[np.ndarray, "B G"]:
    """The stable step as a fraction of the row's passes: (stable_step + 1) / passes, in (0, 1].

    The numerator counts the passes run up to and including the stable pass, so a position stable
    from the first pass of a 256-pass row is at 1/256 and the last pass is 1.0: "within 25% of the
    steps" means the stable pass is one of the first quarter of the row's passes. A row of one pass
    puts all its positions at 1.0 (its only pass is all of its steps). NaN where there is no stable
    step (early-stop fills).
    """
    step = stable_step(trace)
    passes = np.maximum(np.asarray(trace.passes), 1)[:, None]
    return np.where(step >= 0, (step + 1) / passes, np.nan)


def stable_within(trace: Trace, share: float = 0.25) -> float:
    """Share of decided positions whose stable fraction is <= `share` (the paper: 63.7% at 0.25).

    The denominator is every decided position of every row; a decided position without a stable
    step (only in a malformed trace) counts as not within. NaN when the trace decided nothing.
    """
    frac = stable_fraction(trace)[decided(trace)]
    if frac.size == 0:
        return float("nan")
    return float(np.mean(np.nan_to_num(frac, nan=np.inf) <= share))


def stable_histogram(trace: Trace, edges: Float[np.ndarray, "K1"] = FRACTION_EDGES) -> Int[np.ndarray, "K"]:
    """Counts of decided positions per stable-fraction bin, right-closed: edges[k] < f <= edges[k + 1].

    Right-closed because fractions are (step + 1) / passes in (0, 1]: the cumulative count up to
    an edge e is then exactly the number within e (so at 0.25 it matches `stable_within`).
    """
    frac = stable_fraction(trace)[decided(trace)]
    frac = frac[np.isfinite(frac)]
    k = np.clip(np.searchsorted(edges, frac, side="left") - 1, 0, len(edges) - 2)
    return np.bincount(k, minlength=len(edges) - 1)


# ---------------------------------------------------------------- Figure 1c: consistency vs confidence


class BinnedConsistency(NamedTuple):
    consistent: Int[np.ndarray, "*P K"]  # consistent predictions per bin
    total: Int[np.ndarray, "*P K"]  # predictions per bin
    edges: Float[np.ndarray, "K1"]

    @property
    def rate(self) -> Float[np.ndarray, "*P K"]:
        """consistent / total per bin; NaN for empty bins."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.total > 0, self.consistent / np.maximum(self.total, 1), np.nan)


def consistency_by_confidence(trace: Trace, edges: Float[np.ndarray, "K1"] = CONFIDENCE_EDGES) -> BinnedConsistency:
    """Scored predictions (still masked, observed, decided) binned by confidence, and how many were consistent.

    Bins are [edges[k], edges[k + 1]) with confidence 1.0 in the last bin. The commit pass's own
    prediction counts: the position was masked when that pass ran, and the question is how often
    a prediction of that confidence already is the final token.
    """
    counted = scored(trace)
    k = confidence_bin(trace.conf[counted], edges)
    hit = consistent(trace)[counted]
    K = len(edges) - 1
    return BinnedConsistency(np.bincount(k[hit], minlength=K), np.bincount(k, minlength=K), np.asarray(edges))


def consistent_given_confidence_above(trace: Trace, threshold: float = 0.8) -> float:
    """Share of scored predictions with confidence > threshold (strictly) that are consistent (paper: 97.8% at 0.8).

    NaN when no scored prediction is that confident.
    """
    counted = scored(trace) & (trace.conf > in_conf_dtype(trace.conf, threshold))
    n = int(counted.sum())
    return float((consistent(trace) & counted).sum() / n) if n else float("nan")


# ---------------------------------------------------------------- Figure 2: neighbours of a committed token


def neighbour_consistency(trace: Trace, max_distance: int = 8, edges: Float[np.ndarray, "K1"] = CONFIDENCE_EDGES,
                          anchor_split: float = 0.9) -> BinnedConsistency:
    """Consistency of the neighbours of each token committed at a pass, by (panel, |distance|, neighbour bin).

    For every position i committed at pass s (its confidence at s decides the panel: 0 when
    >= anchor_split, 1 when below), and every j = i +- d with 1 <= d <= max_distance inside the
    generated region, the pair counts when j is still masked after pass s (commit_pass[j] > s) and
    pass s computed a prediction at j. Neighbours committed before s, or at s together with i, are
    left out: their prediction at s is their final token by construction, so counting them would
    measure the rule (LocalLeap commits exactly such neighbours) rather than the model. Early-stop
    fills are never neighbours (commit_pass -1). Distances are folded (left and right both count
    at |d|); each (anchor, neighbour) pair is one observation, so a neighbour of two anchors counts
    twice. The result's arrays have shape [2, max_distance, K]; distance d is row d - 1.
    """
    s = _pass_index(trace)
    G = trace.pred.shape[2]
    K = len(edges) - 1
    conf = np.asarray(trace.conf)
    in_row = s < np.asarray(trace.passes)[:, None, None]
    anchor = trace.committed & in_row & np.isfinite(conf)
    split = in_conf_dtype(conf, anchor_split)
    panels = (anchor & (conf >= split), anchor & (conf < split))
    neighbour = (np.asarray(trace.commit_pass)[:, None, :] > s) & observed(trace)
    hit = consistent(trace)
    k = confidence_bin(conf, edges)
    hits = np.zeros((2, max_distance, K), np.int64)
    total = np.zeros((2, max_distance, K), np.int64)
    for d in range(1, max_distance + 1):
        for shift in (d, -d):  # neighbour j = i + shift
            if d >= G:
                continue
            at_i = slice(max(0, -shift), G - max(0, shift))
            at_j = slice(max(0, shift), G + min(0, shift))
            for p, is_anchor in enumerate(panels):
                pair = is_anchor[..., at_i] & neighbour[..., at_j]
                total[p, d - 1] += np.bincount(k[..., at_j][pair], minlength=K)
                hits[p, d - 1] += np.bincount(k[..., at_j][pair & hit[..., at_j]], minlength=K)
    return BinnedConsistency(hits, total, np.asarray(edges))


# ---------------------------------------------------------------- Figure 1a: one row's picture


class DecodePicture(NamedTuple):
    """Row b over its own passes: what Figure 1a draws."""

    consistent: Bool[np.ndarray, "S G"]  # prediction equals the final token
    conf: Float[np.ndarray, "S G"]  # NaN where not computed
    masked: Bool[np.ndarray, "S G"]  # still masked when the pass ran (the prediction was a candidate)
    observed: Bool[np.ndarray, "S G"]  # the pass computed a prediction there
    commit_pass: Int[np.ndarray, "G"]  # -1: early-stop fill
    token: Int[np.ndarray, "G"]


def decode_picture(trace: Trace, b: int) -> DecodePicture:
    """The consistency/confidence matrix of row b, cut to its passes."""
    if not 0 <= b < trace.token.shape[0]:
        raise IndexError(f"row {b} is out of range: the trace holds {trace.token.shape[0]} rows")
    row = trace.row(b)
    return DecodePicture(consistent=consistent(row)[0], conf=np.asarray(row.conf[0]), masked=row.masked[0],
                         observed=observed(row)[0], commit_pass=np.asarray(row.commit_pass[0]),
                         token=np.asarray(row.token[0]))


# ---------------------------------------------------------------- the headline numbers


def revocations(trace: Trace) -> dict:
    """How often and where a rule took commits back: remasks per row, per clause, the share of positions ever
    remasked, and their distance (in passes) from the commit they undid (JSON-able; zeros for a commit-only rule)."""
    remasked = trace.remasked  # [B, S, G]
    rows = remasked.sum(axis=(1, 2))
    by_clause = {name: int((trace.clause == -(k + 1)).sum()) for k, name in enumerate(trace.remask_names)}
    G = trace.token.shape[1]
    where = np.nonzero(remasked)
    # position of each remask within the generated region (gen_length positions, not the answer cut at EOS), in tenths
    tenths = np.bincount((where[2] * 10) // max(G, 1), minlength=10)[:10] if where[0].size else np.zeros(10, int)
    return {"remasks": int(rows.sum()), "remasks_per_row": float(rows.mean()) if rows.size else float("nan"),
            "positions_ever_remasked": float(remasked.any(axis=1).mean()) if remasked.size else float("nan"),
            "by_clause": by_clause, "by_tenth_of_the_region": tenths.astype(int).tolist()}


def observed_share(trace: Trace) -> float:
    """Of the predictions a commit rule chose among (still masked, decided, one of the row's passes), the share the
    passes computed: 1 without a cache, well below 1 under a cache that runs only the block. NaN when none."""
    in_row = _pass_index(trace) < np.asarray(trace.passes)[:, None, None]
    wanted = trace.masked & in_row & decided(trace)[:, None, :]
    return float(scored(trace).sum() / wanted.sum()) if wanted.any() else float("nan")


def edits(trace: Trace) -> dict:
    """How often and where a rule replaced held tokens by different ones (edits, beside `revocations`' remasks):
    edits per row, per clause, the share of positions ever edited, and where in the generated region, with the
    positions it dropped and inserted (JSON-able; zeros for a rule that never edits)."""
    edited = trace.edited  # [B, S, G]
    rows = edited.sum(axis=(1, 2))
    by_clause = ({name: int((trace.edit == k + 1).sum()) for k, name in enumerate(trace.edit_names)}
                 if trace.edit is not None else {})
    G = trace.token.shape[1]
    where = np.nonzero(edited)
    tenths = np.bincount((where[2] * 10) // max(G, 1), minlength=10)[:10] if where[0].size else np.zeros(10, int)
    return {"edits": int(rows.sum()), "edits_per_row": float(rows.mean()) if rows.size else float("nan"),
            "positions_ever_edited": float(edited.any(axis=1).mean()) if edited.size else float("nan"),
            "by_clause": by_clause, "by_tenth_of_the_region": tenths.astype(int).tolist(),
            # positions dropped and inserted (LLaDA2.2's DELETE / SPLIT; 0 for every other rule)
            "deletes": int(trace.deleted.sum()), "inserts": int(trace.inserted.sum())}


def summary(trace: Trace, cache: str | None = None) -> dict:
    """The two numbers the paper reports, with the counts behind them (JSON-able; NaN for 'no data'). `cache`: the
    cache mode the trace was decoded with, which decides what the stable share means (STABLE_MEANING)."""
    counted = scored(trace)
    return {
        "cache": cache,
        "comparable_to_paper": None if cache is None else cache in COMPARABLE_CACHES,
        "stable_within_25pct_means": STABLE_MEANING.get(cache, "the traces do not record their cache mode"),
        "observed_share_of_masked_predictions": observed_share(trace),
        "stable_within_25pct": stable_within(trace, 0.25),
        "consistent_given_conf_gt_0.8": consistent_given_confidence_above(trace, 0.8),
        "rows": int(trace.token.shape[0]),
        "decided_positions": int(decided(trace).sum()),
        "early_stop_filled_positions": int((~decided(trace)).sum()),
        "scored_predictions": int(counted.sum()),
        "predictions_conf_gt_0.8": int((counted & (trace.conf > in_conf_dtype(trace.conf, 0.8))).sum()),
        "mean_passes": float(np.mean(trace.passes)) if trace.passes.size else float("nan"),
        "revocations": revocations(trace),
        "edits": edits(trace),
    }
