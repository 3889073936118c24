"""Fixed boundary cases for every commit rule, computed by hand (issue #9, issue #13 item 2).

Pure data: no import of the code under test, so the same table checks the eager oracle
(`oracles.rules`, tests/test_reference_rules.py) and the compiled JAX rules.

A `Case` is one row fed `steps` in order: a stateful rule sees them as consecutive passes of the row;
`Step.new_block=True` means the row entered a new block before that pass (reset the state; its
step_in_block is 0). `expect` maps block positions to the clause that commits them; positions not in
it must not commit. The numbers are dyadic (0.75, 0.875, 0.5, ...) so float32 and float64 agree
exactly at every boundary, with one exception written in its `note` (KLASS's KL = ln 2 against
tau_kl = ln 2). Feed `conf`, `margin`, `entropy` to the rule as given (do not recompute them from
`logits`: exp/log are not exact); `logits` ([T][V], -inf allowed) are for KLASS's KL only.

Definitions: /work/notes/rules_spec.md. The rule's signals for one step: `signals(step)`; the commit
mask a rule must return: `expected_mask(step)`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

INF = math.inf


@dataclasses.dataclass(frozen=True)
class Step:
    conf: tuple[float, ...]  # [T] confidence of each block position's prediction
    expect: dict  # {block position: clause}
    candidates: tuple[int, ...] | None = None  # still-masked block positions; None: all T
    pred: tuple[int, ...] | None = None  # [T] predictions (stable reads them); None: all 0
    margin: tuple[float, ...] | None = None  # [T] top-1 minus top-2 probability (margin rule)
    entropy: tuple[float, ...] | None = None  # [T] entropy in nats (eb, entropy rules)
    logits: tuple[tuple[float, ...], ...] | None = None  # [T][V] (klass: its KL between passes)
    step_in_block: int | None = None  # None: passes since the case's last block start
    new_block: bool = False  # the row enters a new block before this pass
    quota: int | None = None  # LLaDA's schedule quota at this pass, by hand (schedule rules)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    rule: str
    settings: dict
    steps: tuple[Step, ...]
    gen_length: int = 8  # the decode shape LLaDA's schedule is computed from
    block_length: int | None = None  # None: the steps' T
    note: str = ""

    @property
    def T(self) -> int:
        return len(self.steps[0].conf)

    def step_indices(self) -> list[int]:
        """step_in_block of each step (explicit, or counted since the last block start)."""
        out, s = [], 0
        for st in self.steps:
            if st.new_block:
                s = 0
            s = s if st.step_in_block is None else st.step_in_block
            out.append(s)
            s += 1
        return out


def signals(step: Step) -> dict:
    """The step as numpy arrays: candidates [T] bool, conf/margin/entropy [T] float64, pred [T] int64,
    logits [T, V] float64 (or None where the case does not give them)."""
    T = len(step.conf)
    cand = np.zeros(T, bool)
    cand[list(range(T)) if step.candidates is None else list(step.candidates)] = True
    arr = lambda v, dt: None if v is None else np.asarray(v, dt)  # noqa: E731
    return {"candidates": cand, "conf": arr(step.conf, np.float64),
            "pred": np.zeros(T, np.int64) if step.pred is None else arr(step.pred, np.int64),
            "margin": arr(step.margin, np.float64), "entropy": arr(step.entropy, np.float64),
            "logits": arr(step.logits, np.float64)}


def expected_mask(step: Step) -> np.ndarray:
    m = np.zeros(len(step.conf), bool)
    m[list(step.expect)] = True
    return m


# Distributions over V = 2 for KLASS, as logits, with their probabilities (exact in any precision):
U = (0.0, 0.0)  # p = (1/2, 1/2): conf 0.5
A = (0.0, -INF)  # p = (1, 0): conf 1
# For these two only the KL against themselves matters (0 exactly: identical inputs); their conf is
# given as a literal in each step, not recomputed.
C = (math.log(3.0), 0.0)  # p = (3/4, 1/4): conf 0.75
D = (math.log(7.0), 0.0)  # p = (7/8, 1/8): conf 0.875
C2 = (0.0, math.log(3.0))  # p = (1/4, 3/4): KL(C || C2) = KL(C2 || C) = ln(3)/2 ~ 0.549
D2 = (0.0, math.log(7.0))  # p = (1/8, 7/8): KL(D || D2) = KL(D2 || D) = (3/4) ln 7 ~ 1.46

BELOW_HALF = 0.49609375  # 0.5 - 1/256
BELOW_3_4 = 0.74609375  # 0.75 - 1/256
LN2 = math.log(2.0)
ABOVE_LN2 = 0.693359375  # 355/512, the dyadic just above ln 2 = 0.693147...


CASES: list[Case] = [
    # ---------------------------------------------------------------- low_confidence
    Case("low_confidence/quota_larger_than_candidates", "low_confidence", {"steps": 2},
         (Step(conf=(0.5, 0.25, 0.5, 0.5, 0.5, 0.75, 0.5, 0.5), candidates=(1, 5), quota=4,
               expect={5: "top1", 1: "schedule"}),),
         note="8 over 2 steps: quota 4, two candidates: both commit"),
    Case("low_confidence/remainder_first_and_tie_to_lowest", "low_confidence", {"steps": 3},
         (Step(conf=(0.5, 0.75, 0.25, 0.875, 0.5, 0.125, 0.75, 0.5), step_in_block=1, quota=3,
               expect={3: "top1", 1: "schedule", 6: "schedule"}),
          Step(conf=(0.5, 0.75, 0.25, 0.875, 0.5, 0.125, 0.75, 0.5), step_in_block=2, quota=2,
               expect={3: "top1", 1: "schedule"})),
         note="divmod(8, 3) = (2, 2): quotas 3, 3, 2; positions 1 and 6 tie at 0.75: 1 ranks first"),
    Case("low_confidence/steps_none_one_per_step", "low_confidence", {"steps": None},
         (Step(conf=(0.25, 0.75, 0.5, 0.75, 0.5, 0.75, 0.5, 0.25), candidates=(2, 4, 6), quota=1,
               expect={2: "top1"}),),
         gen_length=16, note="steps None = gen_length 16 over 2 blocks: 8 steps per block of 8, quota 1; "
                             "a three-way tie at 0.5 goes to position 2"),
    # ---------------------------------------------------------------- threshold
    Case("threshold/equality_at_kappa", "threshold", {"kappa": 0.75},
         (Step(conf=(0.75, 0.5, 0.875, BELOW_3_4, 0.75, 0.25), candidates=(0, 1, 2, 3, 5),
               expect={2: "top1", 0: "threshold"}),),
         note="0.75 == kappa commits, 0.75 - 1/256 does not, position 4 (0.75) is not a candidate"),
    Case("threshold/none_above_kappa_top1_tie", "threshold", {"kappa": 1.0},
         (Step(conf=(0.5, 0.5, 0.25), expect={0: "top1"}),)),
    Case("threshold/top1_at_kappa_named_top1", "threshold", {"kappa": 0.875},
         (Step(conf=(0.875, 0.875), expect={0: "top1", 1: "threshold"}),)),
    # ---------------------------------------------------------------- localleap
    Case("localleap/anchor_at_radius_both_sides_and_beyond", "localleap", {"kappa": 0.875, "tau": 0.75, "radius": 2},
         (Step(conf=(0.5, 0.5, 0.75, 0.75, 0.5, 0.875, BELOW_3_4, 0.75, 0.75, 0.5, 0.5, 0.75, 0.5, 0.5,
                     0.9375, 0.5),
               expect={14: "top1", 5: "anchor", 3: "relaxed", 7: "relaxed"}),),
         note="anchor 5 (conf == kappa); 3 and 7 at distance 2 == radius with conf == tau: relaxed; 2 and 8 "
              "at distance 3: no; 6 is next to the anchor but just below tau; 11 is 3 from the anchor 14"),
    Case("localleap/radius_zero_is_threshold", "localleap", {"kappa": 0.875, "tau": 0.75, "radius": 0},
         (Step(conf=(0.75, 0.875, 0.75, 0.9375), expect={3: "top1", 1: "anchor"}),)),
    Case("localleap/committed_tokens_are_not_anchors", "localleap", {"kappa": 0.875, "tau": 0.75, "radius": 1},
         (Step(conf=(0.75, 0.875, 0.75, 0.5), candidates=(0, 2, 3), expect={0: "top1"}),),
         note="position 1 (0.875) is already committed: no anchor, so 0 and 2 (== tau) only top1 (tie: 0)"),
    Case("localleap/top1_anchor_relaxes_its_neighbour", "localleap", {"kappa": 0.875, "tau": 0.75, "radius": 1},
         (Step(conf=(0.9375, 0.75, 0.5), expect={0: "top1", 1: "relaxed"}),)),
    Case("localleap/tau_equal_kappa", "localleap", {"kappa": 0.75, "tau": 0.75, "radius": 1},
         (Step(conf=(0.75, 0.5, 0.75), expect={0: "top1", 2: "anchor"}),)),
    # ---------------------------------------------------------------- dynamic (SDAR)
    Case("dynamic/strictly_above_and_enough", "dynamic", {"threshold": 0.75, "steps": 4},
         (Step(conf=(0.875, 0.75, 0.5, 0.25, 0.9375, 0.5, 0.75, 0.125), quota=2,
               expect={0: "threshold", 4: "threshold"}),),
         note="8 over 4 steps: quota 2; 0.875 and 0.9375 are above 0.75, the two at exactly 0.75 are not (SDAR's >)"),
    Case("dynamic/too_few_above_takes_the_schedule", "dynamic", {"threshold": 0.75, "steps": 4},
         (Step(conf=(0.5, 0.875, 0.75, 0.25, 0.5, 0.5, 0.75, 0.125), quota=2,
               expect={1: "schedule", 2: "schedule"}),),
         note="only 0.875 is above: fewer than the quota 2, so the 2 most confident (0.75 tie: position 2 first)"),
    Case("dynamic/quota_past_the_masks_commits_only_masks", "dynamic", {"threshold": 0.75, "steps": 2},
         (Step(conf=(0.9375, 0.25, 0.875, 0.5, 0.5, 0.5, 0.5, 0.5), candidates=(1, 3), quota=4,
               expect={1: "schedule", 3: "schedule"}),),
         note="quota 4 with two masks left: both commit and nothing else (SDAR's top-k would also overwrite "
              "the decoded positions 0 and 2)"),
    # ---------------------------------------------------------------- factor
    Case("factor/equality_at_rank_3", "factor", {"f": 1.0},
         (Step(conf=(0.75, 0.9375, 0.5, 0.875, 0.75), expect={1: "top1", 3: "factor", 0: "factor"}),),
         note="ranks 1..5 = positions 1, 3, 0, 4, 2 (0 and 4 tie: 0 first); rank 2: 3 * 0.125 = 0.375 <= 1; "
              "rank 3: 4 * 0.25 = 1 <= 1 (equality commits); rank 4: 5 * 0.25 = 1.25 > 1 stops"),
    Case("factor/failing_last_candidate_commits_as_the_authors_code", "factor", {"f": 1.0},
         (Step(conf=(0.9375, 0.875, 0.25), expect={0: "top1", 1: "factor", 2: "factor"}),),
         note="rank 3 is the last and fails (0.25 < 1 - 1/4). Fast-dLLM's get_transfer_index_dynamic commits "
              "it anyway (top_i == len(threshs) - 1 -> top_i += 1): the default, as their published numbers"),
    Case("factor/two_candidates_both_commit", "factor", {"f": 1.0},
         (Step(conf=(0.9375, 0.125, 0.5), candidates=(0, 1), expect={0: "top1", 1: "factor"}),),
         note="two candidates: rank 2 fails (0.125 < 1 - 1/3) and is the last, so both commit"),
    Case("factor/a_failure_before_the_last_stops", "factor", {"f": 1.0},
         (Step(conf=(0.9375, 0.25, 0.9375, 0.125), expect={0: "top1", 2: "factor"}),),
         note="ranks 0 (0.9375), 2 (0.9375), 1 (0.25), 3: rank 3 fails (0.25 < 0.75) with one more after it: "
              "the top two only, branch or not"),
    Case("factor/textbook_leaves_a_failing_last_candidate", "factor", {"f": 1.0, "textbook": 1},
         (Step(conf=(0.9375, 0.875, 0.25), expect={0: "top1", 1: "factor"}),
          Step(conf=(0.9375, 0.125, 0.5), candidates=(0, 1), expect={0: "top1"})),
         note="textbook=1: the formula alone, (i + 1)(1 - c_(i)) <= f for every rank i <= n"),
    Case("factor/equality_at_rank_2", "factor", {"f": 0.75},
         (Step(conf=(0.75, 0.875, 0.75, 0.5), expect={1: "top1", 0: "factor"}),),
         note="rank 2 (position 0): 3 * 0.25 = 0.75 <= 0.75; rank 3 (position 2): 4 * 0.25 = 1 > 0.75"),
    Case("factor/single_candidate", "factor", {"f": 1.0},
         (Step(conf=(0.125, 0.5), candidates=(0,), expect={0: "top1"}),)),
    Case("factor/all_pass", "factor", {"f": 4.0},
         (Step(conf=(0.5, 0.5, 0.5), expect={0: "top1", 1: "factor", 2: "factor"}),),
         note="3 * 0.5 = 1.5 and 4 * 0.5 = 2, both <= 4"),
    # ---------------------------------------------------------------- eb
    Case("eb/prefix_sum_equal_to_gamma", "eb", {"gamma": 0.25},
         (Step(conf=(0.5, 0.25, 0.5, 0.875, 0.125), entropy=(0.125, 0.5, 0.125, 0.0, 1.0),
               expect={3: "entropy_budget", 0: "entropy_budget", 2: "entropy_budget", 1: "entropy_budget"}),),
         note="ascending: 3 (0), 0 (0.125), 2 (0.125), 1 (0.5), 4 (1.0); sums before each: 0, 0, 0.125, 0.25 "
              "(== gamma: position 1 commits, though its own entropy 0.5 > gamma), 0.75 stops"),
    Case("eb/prefix_sum_just_over_gamma", "eb", {"gamma": 0.2490234375},
         (Step(conf=(0.5, 0.25, 0.5, 0.875, 0.125), entropy=(0.125, 0.5, 0.125, 0.0, 1.0),
               expect={3: "entropy_budget", 0: "entropy_budget", 2: "entropy_budget"}),),
         note="gamma = 0.25 - 1/1024: the sum 0.25 before position 1 exceeds it"),
    Case("eb/gamma_zero_leaves_the_most_confident_out", "eb", {"gamma": 0.0},
         (Step(conf=(0.25, 0.5, 0.875), entropy=(0.5, 0.0, 1.0),
               expect={1: "entropy_budget", 0: "entropy_budget"}),),
         note="ascending 1 (0), 0 (0.5), 2 (1.0): sums before 0, 0 (<= 0), 0.5; the most confident (2) has "
              "the highest entropy and does not commit: EB ranks by entropy only"),
    Case("eb/cut_between_tied_entropies", "eb", {"gamma": 0.25},
         (Step(conf=(0.5, 0.5, 0.5), entropy=(0.25, 0.25, 0.25), expect={0: "entropy_budget", 1: "entropy_budget"}),),
         note="sums before: 0, 0.25, 0.5: the tie is cut after position 1"),
    # ---------------------------------------------------------------- margin / entropy
    Case("margin/tie_and_the_most_confident_outside_the_quota", "margin", {"steps": 4},
         (Step(conf=(0.5, 0.625, 0.75, 0.875), margin=(0.25, 0.5, 0.5, 0.125), quota=2,
               expect={1: "schedule", 2: "schedule"}),),
         note="gen 8, block 4, steps 4: 2 steps per block, quota 2; margins 1 and 2 tie (1 first); the most "
              "confident (3, smallest margin) does not commit"),
    Case("margin/most_confident_inside_the_quota", "margin", {"steps": 4},
         (Step(conf=(0.875, 0.5, 0.5), margin=(0.5, 0.25, 0.5), quota=2, expect={0: "schedule", 2: "schedule"}),),
         gen_length=6, note="block 3 of gen 6, steps 4: 2 per block, divmod(3, 2) = (1, 1): quota(0) = 2"),
    Case("margin/quota_larger_than_candidates", "margin", {"steps": 4},
         (Step(conf=(0.5, 0.5, 0.5, 0.5, 0.875), margin=(0.5, 0.5, 0.5, 0.5, 0.125), candidates=(4,), quota=3,
               expect={4: "schedule"}),),
         gen_length=10, note="block 5 of gen 10, steps 4: divmod(5, 2) = (2, 1): quota(0) = 3 > 1 candidate"),
    Case("entropy/tie_in_entropy", "entropy", {"steps": 4},
         (Step(conf=(0.875, 0.5, 0.5, 0.25), entropy=(0.5, 0.25, 0.25, 1.0), quota=2,
               expect={1: "schedule", 2: "schedule"}),),
         note="block 4 of gen 8, steps 4: quota 2; entropies of 1 and 2 tie (1 first); 0 is the most confident"),
    Case("entropy/remainder_step", "entropy", {"steps": 3},
         (Step(conf=(0.5, 0.75, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25),
               entropy=(0.0, 0.125, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0), step_in_block=2, quota=2,
               expect={0: "schedule", 2: "schedule"}),),
         note="one block of 8, steps 3: divmod(8, 3) = (2, 2), quota(2) = 2; zero entropies tie (0 then 2)"),
    # ---------------------------------------------------------------- klass
    Case("klass/fewer_than_history_then_stable_and_tau_c_equality", "klass",
         {"tau_c": 0.5, "tau_kl": 0.25, "history": 2},
         (Step(conf=(0.875, 0.875, 0.875, 0.75, 0.5, 0.75), logits=(D, D, D, C, U, C), quota=1,
               expect={0: "fallback"}),
          Step(conf=(0.875, 0.875, 0.875, 0.75, 0.5, 0.75), logits=(D, D, D, C, U, C2), candidates=(1, 2, 3, 4, 5),
               quota=1, expect={1: "fallback"}),
          Step(conf=(0.875, 0.875, 0.875, 0.75, 0.5, 0.75), logits=(D, D, D, C, U, C), candidates=(2, 3, 4, 5),
               quota=1, expect={2: "stable_kl", 3: "stable_kl"})),
         block_length=6, gen_length=12,
         note="pass 0: no previous distribution; pass 1: one KL (< history 2): the fallback (quota 1, steps None) "
              "takes the most confident; pass 2: positions 2, 3 have two zero KLs and conf > 0.5; position 4 has "
              "conf == tau_c (not >); position 5's KLs at passes 1 and 2 are ln(3)/2 > tau_kl"),
    Case("klass/kl_equal_to_tau_kl_is_not_stable", "klass", {"tau_c": 0.5, "tau_kl": LN2, "history": 1},
         (Step(conf=(1.0, 1.0, 0.5, 0.75), logits=(A, A, U, C), quota=1, expect={0: "fallback"}),
          Step(conf=(1.0, 1.0, 1.0, 0.75), logits=(A, A, A, C), candidates=(1, 2, 3), quota=1,
               expect={1: "stable_kl", 3: "stable_kl"})),
         note="position 2: KL((1,0) || (1/2,1/2)) = ln 2 == tau_kl, not < tau_kl. Exact only if your log(2) "
              "(inside log_softmax of (0, 0)) and tau_kl = ln 2 round to the same float: true for float64 "
              "NumPy; check in float32"),
    Case("klass/kl_just_below_tau_kl_is_stable", "klass", {"tau_c": 0.5, "tau_kl": ABOVE_LN2, "history": 1},
         (Step(conf=(1.0, 1.0, 0.5, 0.75), logits=(A, A, U, C), quota=1, expect={0: "fallback"}),
          Step(conf=(1.0, 1.0, 1.0, 0.75), logits=(A, A, A, C), candidates=(1, 2, 3), quota=1,
               expect={1: "stable_kl", 2: "stable_kl", 3: "stable_kl"})),
         note="tau_kl = 355/512 > ln 2"),
    Case("klass/fallback_takes_the_schedule", "klass", {"tau_c": 0.5, "tau_kl": 0.25, "history": 2, "steps": 4},
         (Step(conf=(0.5, 0.75, 0.75, 0.25), logits=(U, C, C, C2), quota=2, expect={1: "fallback", 2: "fallback"}),),
         note="block 4 of gen 8, steps 4: 2 steps per block, quota 2; nothing is ready at a block's first pass"),
    Case("klass/fallback_quota_larger_than_candidates", "klass", {"tau_c": 0.5, "tau_kl": 0.25, "history": 2,
                                                                  "steps": 4},
         (Step(conf=(0.5, 0.75, 0.75, 0.25), logits=(U, C, C, C2), candidates=(3,), quota=2,
               expect={3: "fallback"}),)),
    Case("klass/fallback_past_the_scheduled_steps", "klass", {"tau_c": 0.5, "tau_kl": 0.25, "history": 2, "steps": 3},
         (Step(conf=(0.5, 0.75, 0.75, 0.25, 0.25, 0.25, 0.25, 0.25), logits=(U, C, C, C2, C2, C2, C2, C2),
               step_in_block=3, quota=2, expect={1: "fallback", 2: "fallback"}),),
         note="one block of 8, steps 3: divmod(8, 3) = (2, 2); pass 3 is past the 3 scheduled passes: quota = "
              "base = 2 (the authors' loop would have left the block). Fresh state: nothing is ready"),
    Case("klass/a_large_kl_restarts_the_count", "klass", {"tau_c": 0.5, "tau_kl": 0.25, "history": 2},
         (Step(conf=(0.875, 0.875, 0.875, 0.875, 0.75), logits=(D, D, D, D, C), quota=1, expect={0: "fallback"}),
          Step(conf=(0.875, 0.875, 0.875, 0.875, 0.75), logits=(D2, D2, D2, D2, C), candidates=(1, 2, 3, 4),
               quota=1, expect={1: "fallback"}),
          Step(conf=(0.875, 0.875, 0.875, 0.875, 0.75), logits=(D, D, D, D, C2), candidates=(2, 3, 4),
               quota=1, expect={2: "fallback"}),
          Step(conf=(0.875, 0.875, 0.875, 0.875, 0.75), logits=(D2, D2, D2, D2, C2), candidates=(3, 4),
               quota=1, expect={3: "fallback"})),
         gen_length=10,
         note="position 4: KL 0 at pass 1, ln(3)/2 at pass 2 (the count restarts), 0 at pass 3: only one "
              "recent small KL, not history 2. The decoys 0-3 alternate D / D2 (KL 1.46), never stable"),
    Case("klass/state_resets_at_a_new_block", "klass", {"tau_c": 0.5, "tau_kl": 0.25, "history": 1},
         (Step(conf=(0.75, 0.75), logits=(C, C), quota=1, expect={0: "fallback"}),
          Step(conf=(0.75, 0.75), logits=(C, C), new_block=True, quota=1, expect={0: "fallback"})),
         block_length=2,
         note="without the reset, position 1's KL against the previous block's pass (0) would make it ready"),
    # ---------------------------------------------------------------- stable
    Case("stable/run_equal_k_and_conf_equal_c_min", "stable", {"k": 2, "c_min": 0.5},
         (Step(conf=(0.875, 0.5, 0.5, 0.75), pred=(1, 2, 3, 4), expect={0: "top1"}),
          Step(conf=(0.875, 0.5, BELOW_HALF, 0.75), pred=(1, 2, 3, 5), candidates=(1, 2, 3),
               expect={3: "top1", 1: "stable"}),
          Step(conf=(0.875, 0.5, 0.5, 0.75), pred=(1, 2, 3, 5), candidates=(2,), expect={2: "top1"})),
         note="pass 1: position 1 has run 2 == k and conf 0.5 == c_min; position 2 is just below c_min; "
              "position 3's prediction changed (run 1)"),
    Case("stable/run_k_minus_one_does_not_commit", "stable", {"k": 3, "c_min": 0.5},
         (Step(conf=(0.875, 0.875, 0.625, 0.625), pred=(5, 6, 7, 8), expect={0: "top1"}),
          Step(conf=(0.875, 0.875, 0.625, 0.625), pred=(5, 6, 7, 9), candidates=(1, 2, 3), expect={1: "top1"}),
          Step(conf=(0.875, 0.875, 0.625, 0.75), pred=(5, 6, 7, 9), candidates=(2, 3),
               expect={3: "top1", 2: "stable"})),
         note="pass 2: position 2 has run 3 == k; position 3 changed at pass 1 (run 2)"),
    Case("stable/a_changed_prediction_restarts_the_run", "stable", {"k": 2, "c_min": 0.5},
         (Step(conf=(0.875, 0.25, 0.5, 0.5), pred=(1, 2, 3, 4), expect={0: "top1"}),
          Step(conf=(0.875, 0.25, 0.75, 0.5), pred=(1, 2, 3, 9), candidates=(1, 2, 3), expect={2: "top1"}),
          Step(conf=(0.875, 0.625, 0.75, 0.75), pred=(1, 5, 3, 9), candidates=(1, 3), expect={3: "top1"})),
         note="position 1 has run 2 at pass 1 (conf too low), then its prediction changes: run 1 at pass 2, "
              "so conf 0.625 does not commit it"),
    Case("stable/k_one_commits_on_first_pass", "stable", {"k": 1, "c_min": 0.75},
         (Step(conf=(0.75, 0.5, 0.875), pred=(1, 1, 1), expect={2: "top1", 0: "stable"}),)),
    Case("stable/state_resets_at_a_new_block", "stable", {"k": 2, "c_min": 0.5},
         (Step(conf=(0.75, 0.75), pred=(7, 7), expect={0: "top1"}),
          Step(conf=(0.75, 0.75), pred=(7, 7), new_block=True, expect={0: "top1"})),
         note="without the reset, position 1 would have run 2"),
]


# Settings under which every clause of every rule commits something on the tests' sharp random model (a
# 2-layer LLaDA-layout model with its head scaled x20, gen 32, block 8): tests/test_decode.py and
# tests/test_reference_rules.py check that each clause really happens there.
EVERY_RULE = {
    "low_confidence": dict(steps=16),
    "threshold": dict(kappa=0.8),
    "dynamic": dict(threshold=0.8, steps=16),
    "localleap": dict(kappa=0.9, tau=0.6, radius=3),
    "factor": dict(f=1.0),
    "eb": dict(gamma=0.3),
    "margin": dict(steps=16),
    "entropy": dict(steps=16),
    "klass": dict(tau_c=0.5, tau_kl=0.05, history=1, steps=16),
    "stable": dict(k=2, c_min=0.5),
}
