"""Rules that take commits back: WINO, Saber and the ReMDM-style loop of Saber's repository.

Each returns `Decision(commit, remask)` (see `base`); the loop applies the commits, then the remasks, and runs
until nothing is masked or `DecodeConfig.max_passes`. They follow the authors' code where it and the papers
differ (read whole: the step and NFE counting included; `oracles.revoke` is the eager
transcription the tests compare with, batch 1, greedy).
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct

from localleap_jax.rules.base import (Decision, DecodeError, RuleBase, Signals, first_clause, most_confident, per_row,
                                      setting, top_k)
from localleap_jax.rules.registry import register_rule


def lowest_k(score, candidates, k):
    """The k candidates with the lowest score (ties: the lower position first)."""
    return top_k(-score, candidates, k)


@register_rule("wino")
@struct.dataclass
class Wino(RuleBase):
    """WINO, Wide-In Narrow-Out (Feng-Hong/WINO-DLLM `LLaDA/decoding.py` `decoding_wino`).

    Wide-in: commit the block's masked positions with confidence > threshold (strict), at most
    min(max(int(0.7 x #masked), 5), 20) of them (the most confident), at least the most confident one.
    Narrow-out, only when more than one was committed this pass: the block's tokens decoded before this pass
    whose held-out probability (`signals.held_out`: the probability of the token held, scored by a masked copy of
    the block appended to the canvas, in the same forward pass) is < threshold_back (strict) are remasked, at
    most last_accept - 1 of them (the lowest), last_accept being the previous pass's commits (30 when a block
    starts). The authors hard-code 0.7, 5, 20 and 30; so does this rule.
    """

    threshold: float = setting(0.6, low=0.0, high=1.0)
    threshold_back: float = setting(0.9, low=0.0, high=1.0)
    clause_names = ("top1", "wide_in")
    remask_names: ClassVar[tuple[str, ...]] = ("narrow_out",)
    probes: ClassVar[bool] = True
    accept_ratio: ClassVar[float] = 0.7
    accept_bounds: ClassVar[tuple[int, int]] = (5, 20)
    first_last_accept: ClassVar[int] = 30

    def init(self, batch, block, vocab):
        return jnp.full((batch,), self.first_last_accept, jnp.int32)  # last_accept

    def update(self, s: Signals, last_accept):
        lo, hi = self.accept_bounds
        cap = jnp.clip(jnp.floor(self.accept_ratio * jnp.sum(s.candidates, axis=1)).astype(jnp.int32), lo, hi)
        over = s.candidates & (s.conf > per_row(self.threshold))
        wide = top_k(s.conf, over, cap)
        commit = first_clause(most_confident(s.conf, s.candidates) & ~jnp.any(over, axis=1, keepdims=True), wide)
        accepted = jnp.sum(commit > 0, axis=1)
        doubtful = s.decoded & (s.held_out < per_row(self.threshold_back)) & (accepted > 1)[:, None]
        remask = lowest_k(s.held_out, doubtful, jnp.maximum(last_accept - 1, 0))
        return Decision(commit, remask), accepted.astype(jnp.int32)

    def pass_bound(self, gen_length, block_length):
        # A pass commits >= 1 and remasks fewer than the previous pass committed (none on a block's first), so a
        # block takes at most block_length passes: gen_length in all.
        return gen_length


@register_rule("saber")
@struct.dataclass
class Saber(RuleBase):
    """Saber (zhaoyMa/Saber `decoding.py` `generate_with_saber`) over the generated region up to the current
    block's end. threshold = the mean, over every position ever committed, of its confidence at its latest
    commit (never cleared on remask; 1.0 before any commit). Commit every masked position of the region with
    confidence > threshold (strict), or, when fewer than n pass, the n most confident. Then, unless nothing up to
    the block's end is masked (the block ends, no remask), remask min(max(n // 2, ceil(fix / 8)), fix - 1) of the
    region's decoded positions (earlier blocks and this pass's commits included), fix = max(n, committed this
    pass): those whose argmax probability dropped most since the previous pass (+inf, last, where either pass
    did not score it; ties: the lower position). Its state spans blocks (the threshold's history and the previous
    confidences), as the authors' does.

    n is 1 or 2: with n >= 3 the authors' top-n near a block's end also returns positions that are not masked
    (torch's filler of a top-k over too few), which this rule cannot follow. The authors' commit 49579a9 divides
    by 8; a later one (c4caa28) by a `mu` of 2: this follows 49579a9.
    """

    n: int = setting(2, int, low=1, high=2)
    clause_names = ("top_n", "threshold")
    remask_names: ClassVar[tuple[str, ...]] = ("dropped",)
    region: ClassVar[str] = "generated"
    resets_state: ClassVar[bool] = False
    divisor: ClassVar[int] = 8

    def init(self, batch, region, vocab):
        # (confidence at each position's latest commit, NaN if never; the previous pass's confidences: 0 before
        # the first pass, as the authors' zeros; -inf where that pass did not score the position)
        return jnp.full((batch, region), jnp.nan, jnp.float32), jnp.zeros((batch, region), jnp.float32)

    def update(self, s: Signals, state):
        final_conf, previous = state
        conf = jnp.where(s.valid, s.conf, -jnp.inf)
        seen = jnp.isfinite(final_conf)
        count = jnp.sum(seen, axis=1)
        threshold = jnp.where(count > 0, jnp.sum(jnp.where(seen, final_conf, 0.0), axis=1) / jnp.maximum(count, 1),
                              1.0)
        n = jnp.asarray(self.n, jnp.int32)
        over = s.candidates & (conf > threshold[:, None])
        enough = (jnp.sum(over, axis=1) >= n)[:, None]
        commit = first_clause(top_k(conf, s.candidates, n) & ~enough, over & enough)
        committed = commit > 0
        fix = jnp.maximum(n, jnp.sum(committed, axis=1))
        k = jnp.minimum(jnp.maximum(n // 2, -(-fix // self.divisor)), fix - 1)
        still_masked = jnp.any(s.candidates & ~committed, axis=1)
        delta = jnp.where(jnp.isfinite(conf) & jnp.isfinite(previous), conf - previous, 1e9)  # 1e9: +inf, ranked last
        held = (s.decoded | committed) & still_masked[:, None]
        remask = lowest_k(delta, held, k)
        final_conf = jnp.where(committed, s.conf, final_conf)
        return Decision(commit, remask), (final_conf, conf)

    def pass_bound(self, gen_length, block_length):
        # A pass that does not end its block commits fix >= n and remasks at most fix - 1: one net token or more.
        # Remasks reach back into earlier blocks, so a block's share is not bounded by its own length: 4 x G
        # covers what the authors' settings take (their own budget is 1024 passes per block).
        return 4 * gen_length


@register_rule("remdm")
@struct.dataclass
class ReMDM(RuleBase):
    """The ReMDM-style loop of Saber's repository (zhaoyMa/Saber `decoding.py` `generate_with_remdm`), on the whole
    canvas (block_length = gen_length). k = unmask_k. G x r / k passes commit the k most confident masked
    positions; then loop_steps rounds of two passes: one remasks the k' = min(k, decoded) decoded positions with
    the lowest probability of the token they hold (and commits nothing), the next commits the k' most confident
    masked positions (the just-remasked among them); then passes commit min(k, masked) until nothing is masked.
    NFE = G r / k + 2 loop_steps + ceil(G (1 - r) / k), every pass counted as the authors count it. (This is the
    Saber repository's deterministic baseline, not the ReMDM paper's stochastic sampler.)
    """

    init_unmask_ratio: float = setting(0.875, low=0.0, high=1.0)
    unmask_k: int = setting(1, int, low=1)
    loop_steps: int = setting(4, int, low=0)
    clause_names = ("schedule",)
    remask_names: ClassVar[tuple[str, ...]] = ("least_likely",)
    region: ClassVar[str] = "generated"

    def init(self, batch, region, vocab):
        return jnp.zeros((batch,), jnp.int32)  # k' of the last remask pass

    def _phases(self, gen_length: int):
        k = jnp.asarray(self.unmask_k, jnp.int32)
        first = jnp.round(gen_length * jnp.asarray(self.init_unmask_ratio, jnp.float32)).astype(jnp.int32) // k
        looping = 2 * jnp.asarray(self.loop_steps, jnp.int32) * (first > 0)  # no decoded token: no rounds
        return k, first, looping

    def update(self, s: Signals, pending):
        k, first, looping = self._phases(s.gen_length)
        step = s.step
        in_loop = (step >= first) & (step < first + looping)
        remask_pass = in_loop & ((step - first) % 2 == 0)
        recommit_pass = in_loop & ~remask_pass
        decoded = jnp.sum(s.decoded, axis=1)
        k_now = jnp.where(remask_pass, jnp.minimum(k, decoded), 0)
        remask = lowest_k(s.held_conf, s.decoded, k_now) & remask_pass[:, None]
        quota = jnp.where(recommit_pass, pending, k)
        commit = top_k(s.conf, s.candidates, quota) & ~remask_pass[:, None]
        return Decision(commit, remask), jnp.where(remask_pass, k_now, pending)

    def validate(self, gen_length=None, block_length=None):
        super().validate()
        if gen_length is None:
            return self
        if block_length is not None and block_length != gen_length:
            raise DecodeError(f"remdm works on the whole canvas: block_length must equal gen_length ({gen_length}), "
                              f"got {block_length}")
        for r, k in zip(np.atleast_1d(np.asarray(self.init_unmask_ratio)).tolist(),
                        np.atleast_1d(np.asarray(self.unmask_k)).tolist()):
            first = gen_length * r
            if r >= 1 or abs(first - round(first)) > 1e-6 or gen_length % k or round(first) % k:
                raise DecodeError(f"remdm: gen_length x init_unmask_ratio ({gen_length} x {r:g}) must be a whole "
                                  f"number below gen_length, and it and gen_length multiples of unmask_k ({k})")
        return self

    def pass_bound(self, gen_length, block_length):
        return max(self._count(gen_length))

    def min_passes(self, gen_length, block_length):
        return min(self._count(gen_length))

    def _count(self, gen_length: int) -> list[int]:
        """The passes the schedule takes (one per row setting)."""
        rows = np.broadcast_arrays(*(np.atleast_1d(np.asarray(v)) for v in (self.init_unmask_ratio, self.unmask_k,
                                                                             self.loop_steps)))
        out = []
        for r, k, loops in zip(*(a.tolist() for a in rows)):
            first = round(gen_length * r)
            out.append(first // k + (2 * loops if first else 0) + math.ceil((gen_length - first) / k))
        return out
