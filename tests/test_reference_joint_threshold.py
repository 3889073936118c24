"""The token-editing oracles (oracles/joint_threshold.py) on hand-made logits: every case's passes, commits and
edits are worked out in the comments from SGLang's rules, then checked; plus the loops' bounds on pseudo-random
logits. Block positions below are absolute unless said otherwise."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from oracles import joint_threshold as JT

V, MASK, DELETE, SPLIT = 20, 19, 18, 17


def _row(token: int, conf: float) -> np.ndarray:
    """Logits whose softmax puts `conf` on `token`, the rest spread evenly (so the runner-up is the lowest other id);
    conf 1.0: every other logit -inf, so the probability is exactly 1.0."""
    if conf >= 1.0:
        out = np.full(V, -np.inf)
        out[token] = 0.0
        return out
    out = np.full(V, np.log((1 - conf) / (V - 1)))
    out[token] = np.log(conf)
    return out


def _positional(plan):
    """logits_fn: row j = _row(*plan(j, ids)); ids is the canvas the pass sees."""
    def fn(ids):
        fn.seen.append(ids.shape[1])
        return np.stack([_row(*plan(j, ids[0])) for j in range(ids.shape[1])])[None]

    fn.seen = []
    return fn


# Prompt [1, 2] and 4 generated tokens in one block of 4 (bidirectional layout: the block is positions 2..5).
BASE = {2: (10, 0.9), 3: (11, 0.3), 4: (12, 0.6), 5: (13, 0.2)}


def _run(plan, **kw):
    settings = {**JT.S_MODE, "layout": "bidirectional", **kw}
    return JT.joint_threshold_generate(_positional(plan), [1, 2], mask_id=MASK, gen_length=4, block_length=4,
                                       **settings)


def test_s_mode_commits_and_a_final_pass_that_changes_nothing():
    # pass 1: masks 2..5; p > 0.5: 2 (0.9), 4 (0.6) commit.  pass 2: 3 (0.3), 5 (0.2): none passes -> the most
    # confident, 3.  pass 3: 5 alone.  pass 4: no mask (post-edit 1 of 16); every argmax equals its token: nothing
    # to commit or edit -> the block ends on this pass, which counts.  NFE 4, no edit.
    out = _run(lambda j, ids: BASE.get(j, (0, 0.9)))
    assert out.tokens.tolist() == [1, 2, 10, 11, 12, 13]
    assert (out.nfe, out.edits, out.commits, out.passes_per_block, out.capped) == (4, 0, 4, [4], 0)
    assert [e["committed"] for e in out.log] == [[2, 4], [3], [5], []] and out.log[-1]["ended"] == "no_change"


def _edit_plan(alt_conf):
    """Position 2 predicts 10 while position 4 is a mask, then 14 at `alt_conf`."""
    def plan(j, ids):
        if j == 2 and ids[4] != MASK:
            return 14, alt_conf
        return BASE.get(j, (0, 0.9))

    return plan


def test_an_edit_in_s_mode():
    # pass 1: 2 -> 10 and 4 -> 12 (as above).  pass 2: position 2 now predicts 14 (0.8 > 0) != 10: edited, and
    # 3 commits (top-1).  pass 3: 5 commits; 2 agrees (14).  pass 4: post-edit, no change: ends.  NFE 4, 1 edit.
    out = _run(_edit_plan(0.8))
    assert out.tokens.tolist() == [1, 2, 14, 11, 12, 13]
    assert (out.nfe, out.edits, out.commits) == (4, 1, 4)
    assert out.log[1]["edited"] == [2] and out.log[1]["committed"] == [3]


@pytest.mark.parametrize("alt_conf, edits, token", [(0.8, 1, 14), (0.4, 0, 10)])
def test_q_mode_edit_threshold(alt_conf, edits, token):
    # Q mode (0.7 / 0.5): pass 1: only 2 (0.9 > 0.7).  pass 2: 3, 4, 5 at .3 .6 .2, none > 0.7: top-1 = 4; position
    # 2 still sees 4 as a mask (predicts 10).  pass 3: 2 predicts 14 at alt_conf: edited iff alt_conf > 0.5; 3
    # commits.  pass 4: 5.  pass 5: post-edit, no change.  NFE 5 either way.
    out = _run(_edit_plan(alt_conf), **JT.Q_MODE)
    assert out.nfe == 5 and out.edits == edits and out.tokens[2] == token


def test_thresholds_are_strict():
    # Every mask at confidence exactly 1.0, threshold 1.0: none is "> 1.0", so each pass commits the single most
    # confident mask (the lowest position): 4 mask passes + the final no-change pass.
    out = _run(lambda j, ids: (10 + j, 1.0), threshold=1.0)
    assert out.nfe == 5 and [e["committed"] for e in out.log[:4]] == [[2], [3], [4], [5]]
    # edit_threshold 1.0: position 2 disagrees at exactly 1.0 once 4 is decoded: not "> 1.0", never edited.
    def plan(j, ids):
        return (14, 1.0) if j == 2 and ids[4] != MASK else BASE.get(j, (0, 0.9))

    assert _run(plan, edit_threshold=1.0).edits == 0 and _run(plan, edit_threshold=0.999).edits == 1


def test_the_post_edit_budget_runs_out():
    # Position 2 always predicts the token it does not hold (10 <-> 14, 0.9); max_post_edit_steps=2.
    # pass 1: 2 -> 10, 4 -> 12.  pass 2: edit 2 -> 14, commit 3.  pass 3: edit 2 -> 10, commit 5.
    # pass 4: post-edit 1: edit -> 14.  pass 5: post-edit 2: edit -> 10.  pass 6: post-edit 3 > 2: the block ends
    # here and changes nothing.  NFE 6 (<= the bound 4 + 2 + 1), 4 edits, position 2 left at 10.
    def plan(j, ids):
        if j == 2:
            return (14 if ids[2] == 10 else 10), 0.9
        return BASE.get(j, (0, 0.9))

    out = _run(plan, max_post_edit_steps=2)
    assert (out.nfe, out.edits, out.tokens[2]) == (6, 4, 10)
    assert out.log[-1]["ended"] == "budget" and out.log[-1]["edited"] == []
    # A larger budget keeps it editing until the budget again: 3 mask passes + 16 post-edit passes + 1.
    out = _run(plan, max_post_edit_steps=16)
    assert out.nfe == 20 == 3 + 16 + 1 and out.edits == 18 and out.capped == 0


def test_the_prompt_tail_is_never_edited():
    # Block-diffusion layout, prompt [1, 2, 3], block 4: block 0 = positions 0..3, prompt tail 0..2. Position 1
    # disagrees with its prompt token at 0.99: never edited.  pass 1: 3 commits.  pass 2: post-edit, no change.
    fn = _positional(lambda j, ids: {1: (15, 0.99), 3: (11, 0.9)}.get(j, (int(ids[j]), 0.9)))
    out = JT.joint_threshold_generate(fn, [1, 2, 3], mask_id=MASK, gen_length=1, block_length=4, **JT.S_MODE)
    assert out.tokens.tolist() == [1, 2, 3, 11] and (out.nfe, out.edits) == (2, 0)
    assert fn.seen == [4, 4]  # the logits of [0, block end)


def test_block_diffusion_blocks_and_logits_prefix():
    # Prompt of 5, G = 6, block 4: ceil(11 / 4) = 3 blocks, decoding from block 1 (positions 4..7, prompt tail 4)
    # then block 2 (8..11). Every position predicts 7 at 0.9: one pass commits a block's masks, one ends it.
    fn = _positional(lambda j, ids: (7, 0.9))
    out = JT.joint_threshold_generate(fn, [1, 2, 3, 4, 5], mask_id=MASK, gen_length=6, block_length=4, **JT.S_MODE)
    assert out.tokens.tolist() == [1, 2, 3, 4, 5, 7, 7, 7, 7, 7, 7, 7]
    assert out.passes_per_block == [2, 2] and fn.seen == [8, 8, 12, 12]


def test_repetition_penalty():
    # Position 3's logits favour 10 (0.5) over 11 (0.45). After 2 commits 10 (pass 1), a penalty of 1 on the
    # previous token (10) at position 3 makes 11 the argmax there.
    def row3():
        out = np.full(V, np.log(0.05 / (V - 2)))
        out[10], out[11] = np.log(0.5), np.log(0.45)
        return out

    def fn(ids):
        rows = [_row(*BASE.get(j, (0, 0.9))) for j in range(ids.shape[1])]
        rows[3] = row3()
        return np.stack(rows)[None]

    for lam, token in [(0.0, 10), (1.0, 11)]:
        out = JT.joint_threshold_generate(fn, [1, 2], mask_id=MASK, gen_length=4, block_length=4,
                                          layout="bidirectional", penalty_lambda=lam)
        assert out.tokens[3] == token


def test_a_predicted_mask_hits_sglangs_step_cap():
    # Position 5 predicts the mask id at 0.9: every pass "commits" it (nothing changes), so 3 (0.3) is never the
    # forced top-1 and the block never ends by itself; SGLang's max_steps = 4 + 2 + 1 = 7 passes stops it.
    plan = {**BASE, 5: (MASK, 0.9)}
    out = _run(lambda j, ids: plan.get(j, (0, 0.9)), max_post_edit_steps=2)
    assert out.nfe == 7 and out.capped == 1 and out.tokens[3] == MASK and out.tokens[5] == MASK
    # never_predict=(MASK,): its runner-up (id 0, tiny probability) instead; 3 then 5 commit by top-1; NFE 4.
    out = _run(lambda j, ids: plan.get(j, (0, 0.9)), never_predict=(MASK,))
    assert out.nfe == 4 and out.capped == 0 and out.tokens.tolist() == [1, 2, 10, 11, 12, 0]


def _pseudo_random(j: int, ids: np.ndarray, vocab: int) -> tuple[int, float]:
    """A prediction that depends on the whole canvas (so edits come and go), deterministic."""
    h = zlib.crc32(ids.tobytes() + bytes([j]))
    return h % vocab, 0.3 + 0.69 * ((h >> 8) % 1000) / 1000


@pytest.mark.parametrize("layout, prompt, gen", [("bidirectional", [1, 2, 3], 12), ("block_diffusion", [1, 2, 3], 9)])
def test_terminates_within_the_bound(layout, prompt, gen):
    T, budget = 4, 40
    fn = _positional(lambda j, ids: _pseudo_random(j, ids, MASK))  # never the mask id
    out = JT.joint_threshold_generate(fn, prompt, mask_id=MASK, gen_length=gen, block_length=T, layout=layout,
                                      threshold=0.5, edit_threshold=0.0, max_post_edit_steps=budget)
    assert all(p <= T + budget + 1 for p in out.passes_per_block) and out.capped == 0
    assert out.nfe == sum(out.passes_per_block) == len(fn.seen) and not (out.tokens == MASK).any()
    assert out.edits > 0 and out.edits == sum(len(e["edited"]) for e in out.log)
    assert any(e["ended"] == "budget" for e in out.log)  # the budget really bounded some block


def test_refuses():
    with pytest.raises(ValueError, match="multiple"):
        JT.joint_threshold_generate(_positional(lambda j, ids: (0, 0.9)), [1], mask_id=MASK, gen_length=6,
                                    block_length=4, layout="bidirectional")
    with pytest.raises(ValueError, match="mask id"):
        JT.joint_threshold_generate(_positional(lambda j, ids: (0, 0.9)), [1, MASK], mask_id=MASK, gen_length=4,
                                    block_length=4)


# ---------------------------------------------------------------------------- insert / delete


def _block_stub(rules, *, lo=2, hi=6):
    """logits_fn over the block's CONTENT: rules(block tuple) -> {block index: (token, conf)}; any other non-mask
    position predicts its own token at 0.9, any other mask 5 at 0.3."""
    def fn(ids):
        block = ids[0, lo:hi]
        special = rules(tuple(int(t) for t in block))
        rows = [_row(1, 0.9)] * lo
        for i, t in enumerate(block):
            rows.append(_row(*special[i]) if i in special else _row(5, 0.3) if t == MASK else _row(int(t), 0.9))
        fn.calls += 1
        return np.stack(rows + [_row(1, 0.9)] * (ids.shape[1] - hi))[None]

    fn.calls = 0
    return fn


def _indel(fn, **kw):
    settings = {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 3, **kw}
    return JT.joint_threshold_indel_generate(fn, [1, 2], mask_id=MASK, delete_id=DELETE, split_id=SPLIT,
                                             gen_length=4, block_length=4, layout="bidirectional", **settings)


M = MASK


def test_indel_delete_pads_a_new_mask():
    # pass 1: [M M M M], 4 original masks, all predicted > 0.5: all commit -> [10 11 12 13].
    # pass 2: no original mask: post-edit 1 (of 3). Index 1 predicts DELETE (0.9): a T2T write; the block is rebuilt
    #         without it and padded with a NEW mask: [10 12 13 M].
    # pass 3: post-edit 2; the mask is introduced (not original): no quota, every mask commits: index 3 -> 5.
    # pass 4: post-edit 3 >= 3: the cleanup pass; nothing to write: the block ends.  NFE 4.
    def rules(b):
        if b == (M, M, M, M):
            return {0: (10, 0.9), 1: (11, 0.8), 2: (12, 0.7), 3: (13, 0.6)}
        if b == (10, 11, 12, 13):
            return {1: (DELETE, 0.9)}
        return {}

    out = _indel(_block_stub(rules))
    assert out.tokens.tolist() == [1, 2, 10, 12, 13, 5]
    assert out.nfe == 4 and out.extra["deletes"] == 1 and out.commits == 5 and out.edits == 0
    assert [e["tokens"] for e in out.log] == [[10, 11, 12, 13], [10, 12, 13, M], [10, 12, 13, 5], [10, 12, 13, 5]]
    assert out.log[-1]["cleanup"] and out.extra["cleanups"] == 1


def test_indel_split_truncates_and_the_quota_counts_introduced_masks():
    # pass 1: [M M M M]: only index 0 passes (0.9; the others .4 .3 .2 are below 0.5): 1 >= quota 1 -> [10 M M M].
    # pass 2: index 0 predicts SPLIT (0.8): T2T; index 1 commits 11 (0.9 > 0.5, quota 1). Rebuild: SPLIT ->
    #         [new M, old 10], then 11, M, M -> 5 tokens, truncated to [M 10 11 M]; flags [new, orig, orig, orig].
    # pass 3: masks: index 0 (introduced) and 3 (original): quota 1 + 1 introduced = 2; index 0 predicts 15 (0.9),
    #         index 3 16 (0.4): only 1 passes < 2 -> the 2 most confident: both -> [15 10 11 16].
    # pass 4: no original mask: post-edit 1; nothing to write: ends.  NFE 4.
    def rules(b):
        if b == (M, M, M, M):
            return {0: (10, 0.9), 1: (11, 0.4), 2: (12, 0.3), 3: (13, 0.2)}
        if b == (10, M, M, M):
            return {0: (SPLIT, 0.8), 1: (11, 0.9)}
        if b == (M, 10, 11, M):
            return {0: (15, 0.9), 3: (16, 0.4)}
        return {}

    out = _indel(_block_stub(rules))
    assert [e["tokens"] for e in out.log] == [[10, M, M, M], [M, 10, 11, M], [15, 10, 11, 16], [15, 10, 11, 16]]
    assert out.nfe == 4 and out.extra["splits"] == 1 and out.commits == 1 + 1 + 2


def test_indel_anti_loop_and_cleanup_scrub():
    # Index 0 flips 10 <-> 14 (0.9) after pass 1 commits [10 11 12 13]; max_post_edit_steps=4.
    # pass 2 (post-edit 1): [10 11 12 13] is new: edit -> 14.   pass 3 (2): [14 ...] new: edit -> 10.
    # pass 4 (3): [10 11 12 13] was seen at the start of pass 2: ANTI-LOOP: the only changing position, 0, takes its
    #   best token not yet written there ({10, 14} written): the even rest's lowest id, 0 -> [0 11 12 13].
    # pass 5 (4 >= 4): CLEANUP: index 0 predicts 10 (edit), index 1 predicts DELETE: scrubbed to its best ordinary
    #   token (0, the lowest of the even rest) instead of deleting. Ends.  NFE 5, edits 1+1+1+2 = 5.
    def rules(b):
        if b == (M, M, M, M):
            return {0: (10, 0.9), 1: (11, 0.9), 2: (12, 0.9), 3: (13, 0.9)}
        out = {0: (14 if b[0] == 10 else 10, 0.9)}
        if b[0] == 0:
            out[1] = (DELETE, 0.9)
        return out

    out = _indel(_block_stub(rules), max_post_edit_steps=4)
    assert [e["tokens"] for e in out.log] == [[10, 11, 12, 13], [14, 11, 12, 13], [10, 11, 12, 13],
                                              [0, 11, 12, 13], [10, 0, 12, 13]]
    assert out.nfe == 5 and out.extra["antiloop"] == 1 and out.extra["deletes"] == 0 and out.edits == 5
    assert out.log[-1]["cleanup"] and out.log[-1]["ended"]


def test_indel_without_post_edit_rounds():
    # max_post_edit_steps=0: the pass that takes the last original masks is the cleanup: one pass.
    out = _indel(_block_stub(lambda b: {i: (10 + i, 0.9) for i in range(4)} if b == (M,) * 4 else {}),
                 max_post_edit_steps=0)
    assert out.nfe == 1 and out.tokens.tolist() == [1, 2, 10, 11, 12, 13] and out.extra["cleanups"] == 1


def test_indel_terminates_within_the_bound_and_leaves_no_special_token():
    T, budget = 4, 6
    fn = _positional(lambda j, ids: _pseudo_random(j, ids, V))  # MASK, DELETE and SPLIT all predicted sometimes
    out = JT.joint_threshold_indel_generate(fn, [1, 2, 3], mask_id=MASK, delete_id=DELETE, split_id=SPLIT,
                                            gen_length=9, block_length=T, threshold=0.5, edit_threshold=0.0,
                                            max_post_edit_steps=budget)
    assert all(p <= T + budget + 1 for p in out.passes_per_block) and out.capped == 0
    assert not np.isin(out.tokens, [MASK, DELETE, SPLIT]).any()
    assert out.extra["deletes"] + out.extra["splits"] > 0  # the case exercised the rebuild


def test_indel_a_mask_written_back_is_no_edit():
    # pass 1: all four commit -> [10 11 12 13].  pass 2 (post-edit 1 of 3): index 0 predicts the MASK id (0.9): a
    # T2T write that leaves a mask (introduced: not original), no edit (an edit writes an ordinary token).
    # pass 3 (post 2): only introduced masks: every mask commits: index 0 -> 5 (the stub's mask default).
    # pass 4 (post 3 >= 3): cleanup; nothing to write: ends.  NFE 4, edits 0, commits 5.
    def rules(b):
        if b == (M, M, M, M):
            return {i: (10 + i, 0.9) for i in range(4)}
        return {0: (MASK, 0.9)} if b == (10, 11, 12, 13) else {}

    out = _indel(_block_stub(rules))
    assert [e["tokens"] for e in out.log] == [[10, 11, 12, 13], [M, 11, 12, 13], [5, 11, 12, 13], [5, 11, 12, 13]]
    assert (out.nfe, out.edits, out.commits) == (4, 0, 5)
