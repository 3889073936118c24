"""The dInfer oracle (oracles/dinfer.py) on hand-made logits: each case's commits, passes and calls are worked out in
the comments from dInfer's rules, then checked. Positions are absolute; the prompt is [1, 2] unless said."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oracles import dinfer as D

V, MASK, EOS = 20, 19, 0


def _row(dist: dict[int, float]) -> np.ndarray:
    """Logits whose softmax puts dist[t] on each token t and spreads the rest evenly over the other ids."""
    rest = (1.0 - sum(dist.values())) / (V - len(dist))
    out = np.full(V, np.log(rest))
    for t, p in dist.items():
        out[t] = np.log(p)
    return out


def _fn(plan):
    """logits_fn: row j = _row(plan(j, ids)) (plan returns None for 'anything': token 5 at 0.3)."""
    def fn(ids):
        fn.calls += 1
        return np.stack([_row(plan(j, ids[0]) or {5: 0.3}) for j in range(ids.shape[1])])[None]

    fn.calls = 0
    return fn


def _run(fn, decoder, *, prompt=(1, 2), gen=4, block=4, **kw):
    return D.generate(fn, list(prompt), decoder=decoder, mask_id=MASK, eos_id=EOS, gen_length=gen, block_length=block,
                      **kw)


def test_threshold_band_non_strict_and_the_mask_argmax_left_out():
    # Block 2..5, threshold 0.95. Position 5's argmax is the mask id (0.96): not a candidate. Best candidate: 2 at
    # 0.9; bound = min(0.9 - 1e-5, 0.95): 2 and 3 (0.899995, inside the band) commit, 4 (0.8) does not.
    plan = {2: {10: 0.9}, 3: {11: 0.899995}, 4: {12: 0.8}, 5: {MASK: 0.96, 13: 0.03}}
    # then 4 (0.8, the best left), then 5: its argmax stays the mask id, nothing commits: dInfer never ends
    # (the oracle says so)
    with pytest.raises(D.Stuck) as stuck:
        _run(_fn(lambda j, ids: plan.get(j)), D.make_decoder("threshold", mask_id=MASK, threshold=0.95))
    assert [e["committed"] for e in stuck.value.result.log] == [[2, 3], [4]]
    # non-strict: every candidate exactly at the threshold commits in one call (p 0.5 >= 0.5)
    dec = D.make_decoder("threshold", mask_id=MASK, threshold=0.5)
    out = _run(_fn(lambda j, ids: {10 + j: 0.5}), dec)
    assert out.log[0]["committed"] == [2, 3, 4, 5] and out.passes == 1


def test_credit_writes_its_fused_argmax():
    # Block 2..4 (G 3), threshold 0.99, credit 0.7 / 0.2 / 0.8. Positions 2 and 4 hold 12 (0.97) and 14 (0.96);
    # position 3's raw argmax is 11 (0.6) while two masks are left, then 12 (0.46, 11 at 0.44).
    #   call 1: fused p: 2 ~ 0.981, 4 ~ 0.975, 3 ~ 0.70 (C3[11] = 0.6^0.2 = 0.9029): no one >= 0.99; the best, 2
    #   call 2: C3[11] = 0.8 * 0.9029 + 0.9029 = 1.6252 (fused p ~ 0.75); 4 is the best
    #   call 3: C3[11] = 0.8 * 1.6252 = 1.3002, C3[12] = 0.46^0.2 = 0.8560
    #           fused 11: ln 0.44 + 0.7 ln 2.3002 = -0.2380 > fused 12: ln 0.46 + 0.7 ln 1.8560 = -0.3436
    #           3, the only candidate, commits 11 where the raw argmax (and the plain threshold decoder) says 12.
    def plan(j, ids):
        if j == 3:
            return {11: 0.6} if (ids[2:5] == MASK).sum() > 1 else {12: 0.46, 11: 0.44}
        return {12: 0.97} if j == 2 else {14: 0.96} if j == 4 else None

    credit = D.make_decoder("credit", mask_id=MASK, threshold=0.99)
    out = _run(_fn(plan), credit, gen=3, block=3)
    assert out.tokens.tolist() == [1, 2, 12, 11, 14] and out.passes == 3 and credit.fused_differs == 1
    assert [e["committed"] for e in out.log] == [[2], [4], [3]]
    plain = _run(_fn(plan), D.make_decoder("threshold", mask_id=MASK, threshold=0.99), gen=3, block=3)
    assert plain.tokens.tolist() == [1, 2, 12, 12, 14]
    # by hand, the same numbers
    c11, c12 = (0.8 * 0.6 ** 0.2 + 0.6 ** 0.2) * 0.8, 0.46 ** 0.2
    assert np.log(0.44) + 0.7 * np.log1p(c11) > np.log(0.46) + 0.7 * np.log1p(c12)
    # a new block starts without credit: two blocks of 3 with the same plan decode alike
    credit = D.make_decoder("credit", mask_id=MASK, threshold=0.99)
    two = _run(_fn(lambda j, ids: plan(2 + (j - 2) % 3, np.concatenate([ids[:2], ids[2 + 3 * ((j - 2) // 3):]]))),
               credit, gen=6, block=3)
    assert two.tokens[2:].tolist() == [12, 11, 14, 12, 11, 14] and credit.fused_differs == 2


def test_hierarchy_segments():
    # Block 2..7, confidences (fixed) [0.5, 0.3, 0.2, 0.6, 0.45, 0.1], low 0.4, threshold None:
    #   call 1: one segment, its max 3 (0.6 > 0.4)                                     -> {5}
    #   call 2: segments 2..4 (max 2: 0.5) and 6..7 (max 6: 0.45 > 0.4)                -> {2, 6}
    #   call 3: segments 3..4 (max 0.3) and 7 (0.1): none above 0.4; the block's best 3 -> {3}
    #   call 4: {4}; call 5: {7}.
    conf = [0.5, 0.3, 0.2, 0.6, 0.45, 0.1]
    fn = _fn(lambda j, ids: {10 + j: conf[j - 2]} if 2 <= j < 8 else None)
    out = _run(fn, D.make_decoder("hierarchy", mask_id=MASK, low_threshold=0.4), gen=6, block=6)
    assert [e["committed"] for e in out.log] == [[5], [2, 6], [3], [4], [7]] and out.passes == 5
    # low_threshold None: every segment's max commits: {5}, {2, 6}, {3, 7}, {4}
    out = _run(fn, D.make_decoder("hierarchy", mask_id=MASK, low_threshold=None), gen=6, block=6)
    assert [e["committed"] for e in out.log] == [[5], [2, 6], [3, 7], [4]]
    # threshold 0.44 (strict): call 1 takes 3 (0.6 > 0.44, segment max) and 2 (0.5), 6 (0.45)
    out = _run(fn, D.make_decoder("hierarchy", mask_id=MASK, threshold=0.44, low_threshold=0.4), gen=6, block=6)
    assert out.log[0]["committed"] == [2, 5, 6]
    # strict low_threshold, ties all commit: two segment maxima exactly 0.4 never pass "> 0.4"; tied 0.45s both do
    tie = [0.45, 0.45, 0.2, 0.4, 0.1, 0.1]
    out = _run(_fn(lambda j, ids: {10 + j: tie[j - 2]} if 2 <= j < 8 else None),
               D.make_decoder("hierarchy", mask_id=MASK, low_threshold=0.4), gen=6, block=6)
    assert out.log[0]["committed"] == [2, 3]  # segment 2..7's max 0.45, twice
    assert out.log[1]["committed"] == [5]  # segment 4..7: max 0.4 is not > 0.4; the block's best (first of equals)


def test_smoothing_schedule_and_soft_input():
    # Two blocks of 4 (G 8). Call t's threshold: max(1 - 0.02 t, 0.9). Block 1 confidences [0.97, 0.975, 0.96, 0.95]:
    #   t=0 (1.00): bound = 0.975 - 1e-5: {3};   t=1 (0.98): best 0.97: {2};   t=2 (0.96): {4} (0.96 >= 0.96);
    #   t=3 (0.94): {5}.  Block 2 [0.95, 0.94, 0.93, 0.96] at t=4 (0.92): all four in one call (a counter reset per
    #   block would be back at 1.0: one at a time). 5 calls; the plain threshold decoder at 0.9 takes 2.
    conf = [0.97, 0.975, 0.96, 0.95, 0.95, 0.94, 0.93, 0.96]
    D_ = 3
    g = torch.Generator().manual_seed(0)
    E = torch.randn(V, D_, generator=g, dtype=torch.float64)
    seen = []
    fixed = torch.as_tensor(np.stack([_row({10 + j % 8: conf[j - 2]} if 2 <= j < 10 else {5: 0.3})
                                      for j in range(10)]))

    def embeds_fn(embeds):
        seen.append(embeds.clone())
        return fixed[None]

    smooth = D.Smoothing(embeds_fn, E)
    out = D.generate(None, [1, 2], decoder=D.make_decoder("threshold", mask_id=MASK, threshold=0.9), mask_id=MASK,
                     eos_id=EOS, gen_length=8, block_length=4, smoothing=smooth)
    assert [e["committed"] for e in out.log] == [[3], [2], [4], [5], [6, 7, 8, 9]] and out.passes == 5
    plain = _run(lambda ids: fixed.numpy()[None], D.make_decoder("threshold", mask_id=MASK, threshold=0.9), gen=8)
    assert plain.passes == 2
    # the inputs: call 0 sees E[x]; call 1 sees E[x] + w_0 softmax(logits_0) @ E at the positions still masked after
    # call 0 (all but 3: the second block too), w_0 = min(0.15 + 0 * 0.02, 0.3) = 0.15; call 4: w_3 = 0.21
    # (position j predicts 10 + j % 8)
    x0 = torch.tensor([1, 2] + [MASK] * 8)
    assert torch.equal(seen[0][0], E[x0])
    expected = E[torch.tensor([1, 2, MASK, 13, MASK, MASK, MASK, MASK, MASK, MASK])]
    still = torch.tensor([False, False, True, False, True, True, True, True, True, True])
    expected[still] += 0.15 * (torch.softmax(fixed, -1) @ E)[still]
    torch.testing.assert_close(seen[1][0], expected)
    x3 = torch.tensor([1, 2, 12, 13, 14, 15] + [MASK] * 4)
    expected = E[x3]
    expected[6:] += 0.21 * (torch.softmax(fixed, -1) @ E)[6:]
    torch.testing.assert_close(seen[4][0], expected)


def test_unrolled_calls_and_eos():
    # Whole canvas, G = block 16, every candidate at 0.95 (>= 0.9): the first call fills the block; dInfer's round is
    # max(min(16 // 8, 4), 1) = 2 calls, so one more call runs on the full block: 2 forwards, 1 pass.
    fn = _fn(lambda j, ids: {10: 0.95})
    out = _run(fn, D.make_decoder("threshold", mask_id=MASK, threshold=0.9), gen=16, block=16)
    assert (out.forwards, out.passes, fn.calls) == (2, 1, 2)
    out = _run(fn, D.make_decoder("threshold", mask_id=MASK, threshold=0.9), gen=16, block=16, maximum_unroll=1)
    assert (out.forwards, out.passes) == (1, 1)
    # The block runner makes at least 2 calls a round: block diffusion, prompt [1, 2, 3] on the grid of 4 (its first
    # block holds 3 prompt tokens and a mask), G 5: blocks 0..3 and 4..7, one call each fills them: 4 forwards, 2 passes
    out = _run(_fn(lambda j, ids: {10: 0.95}), D.make_decoder("threshold", mask_id=MASK, threshold=0.9),
               prompt=(1, 2, 3), gen=5, block=4, layout="block_diffusion")
    assert (out.forwards, out.passes, out.tokens.tolist()) == (4, 2, [1, 2, 3, 10, 10, 10, 10, 10])
    # EOS in a block stops the runner after it: early_stop fills the rest with EOS, else leaves it masked
    plan = lambda j, ids: {EOS: 0.95} if j == 3 else {10: 0.95}  # noqa: E731
    out = _run(_fn(plan), D.make_decoder("threshold", mask_id=MASK, threshold=0.9), gen=8, block=4)
    assert out.stopped and out.tokens.tolist() == [1, 2, 10, EOS, 10, 10] + [EOS] * 4
    out = _run(_fn(plan), D.make_decoder("threshold", mask_id=MASK, threshold=0.9), gen=8, block=4, early_stop=False)
    assert out.stopped and out.tokens.tolist() == [1, 2, 10, EOS, 10, 10] + [MASK] * 4
