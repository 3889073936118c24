"""The eager oracles of decoding loops that revoke commits (oracles/revoke.py): WINO, Saber and
the ReMDM-style loop, run on a tiny random LLaDA with a sharp head (2 layers, seed 11, head x20).

The rule checkers below re-derive each rule's counting from the authors' formulas (written out here again,
not taken from the module), so a wrong count in the oracle, or a broken variant, fails them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import random_llada_tensors, tiny_hf_config
from oracles import revoke as R

PROMPT_TEXT = "Mia has 3 apples"  # 8 tokens with the session tokenizer


@pytest.fixture(scope="module")
def setup(tiny_tokenizer):
    from oracles.bidirectional import llama_from_llada

    tok = tiny_tokenizer
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id, n_layers=2)
    model = llama_from_llada(cfg, random_llada_tensors(cfg, seed=11, head_scale=20.0))
    prompt = tok.encode(PROMPT_TEXT)
    assert 6 <= len(prompt) <= 10, prompt
    return {"model": model, "logits": R.logits_fn_from_model(model), "masked": R.masked_logits_fn_from_model(model),
            "prompt": prompt, "mask": tok.mask_token_id}


def counting(fn):
    calls = []

    def wrapped(*args):
        calls.append(1)
        return fn(*args)

    return wrapped, calls


# ------------------------------------------------------------------------------------------------ log checks


def replay(res: R.RevokeResult, prompt, mask_id, gen_length):
    """Replays the log on a masked/held canvas: a commit only fills a masked generated position, a remask only
    takes back a held one (committed in an earlier pass, or earlier in the same pass), the prompt is never
    touched, the totals and NFE agree, and nothing is left masked. Returns the open count before each pass."""
    P, L = len(prompt), len(prompt) + gen_length
    assert res.tokens[:P] == list(prompt)
    assert len(res.tokens) == L
    held = np.zeros(L, dtype=bool)
    held[:P] = True
    open_before = []
    assert len(res.log) == res.nfe
    for i, e in enumerate(res.log):
        assert e["pass"] == i
        assert set(e) == {"pass", "block", "committed", "remasked"}
        open_before.append(int((~held).sum()))
        for j in e["committed"]:
            assert P <= j < L and not held[j], (i, j)
            held[j] = True
        for j in e["remasked"]:
            assert P <= j < L and held[j], (i, j)  # a remasked position was committed before
            held[j] = False
    assert held.all()
    assert mask_id not in res.tokens[P:]
    assert sum(len(e["committed"]) for e in res.log) == res.commits
    assert sum(len(e["remasked"]) for e in res.log) == res.remasks
    assert res.commits - res.remasks == gen_length
    return open_before


def check_wino(res, P, G, B):
    """WINO's counting: passes of a block in one run, commits within [P, block end), 1 <= commits <=
    min(max(int(0.7 * open), 5), 20), remasks only of this block, only when > 1 was committed, and at most
    (previous pass's commits - 1) (29 in a block's first pass); at most B passes a block."""
    blocks = [e["block"] for e in res.log]
    assert blocks == sorted(blocks) and set(blocks) == set(range(G // B))
    last, block = None, None
    open_ = np.zeros(P + G, dtype=bool)
    open_[P:] = True
    for e in res.log:
        b = e["block"]
        lo, hi = P + b * B, P + (b + 1) * B
        if b != block:
            block, last = b, 30
            assert not open_[:lo].any()
        c, r = e["committed"], e["remasked"]
        n_open = int(open_[:hi].sum())
        assert 1 <= len(c) <= min(max(int(0.7 * n_open), 5), 20), e
        assert all(lo <= j < hi for j in c) and all(lo <= j < hi for j in r), e
        assert not set(c) & set(r)
        if len(c) <= 1:
            assert not r, e
        assert len(r) <= last - 1, (e, last)
        open_[c] = False
        open_[r] = True
        last = len(c)
    for b in range(G // B):
        assert blocks.count(b) <= B


def check_saber(res, P, G, B, n, mu):
    """Saber's counting: commits in [P, block end), at least min(n, open up to the end); a block's last pass
    leaves nothing masked up to its end and remasks nothing; every other pass leaves a mask and remasks
    exactly min(max(n // 2, ceil(fix / mu)), fix - 1), fix = max(n, commits), all decoded positions < end."""
    blocks = [e["block"] for e in res.log]
    assert blocks == sorted(blocks) and set(blocks) == set(range(G // B))
    open_ = np.zeros(P + G, dtype=bool)
    open_[P:] = True
    for i, e in enumerate(res.log):
        end = P + (e["block"] + 1) * B
        c, r = e["committed"], e["remasked"]
        assert len(c) >= min(n, int(open_[:end].sum())) and all(P <= j < end for j in c), e
        open_[c] = False
        last_of_block = i + 1 == len(res.log) or res.log[i + 1]["block"] != e["block"]
        if last_of_block:
            assert not r and not open_[:end].any(), e
        else:
            assert open_[:end].any()
            fix = max(n, len(c))
            assert len(r) == min(max(n // 2, math.ceil(fix / mu)), fix - 1), e
            assert all(P <= j < end and not open_[j] for j in r), e
        open_[r] = True


def check_remdm(res, G, r, k, loops):
    """ReMDM's phases: G*r/k passes of k commits; loops x (a remask-only pass of k, a commit-only pass of k);
    then passes of min(k, masked) commits. NFE = G*r/k + 2*loops + ceil(G*(1-r)/k)."""
    n1 = int(G * r) // k
    n3 = math.ceil((G - int(G * r)) / k)
    assert res.nfe == n1 + 2 * loops + n3
    phase1, phase2, phase3 = res.log[:n1], res.log[n1:n1 + 2 * loops], res.log[n1 + 2 * loops:]
    assert all(len(e["committed"]) == k and not e["remasked"] for e in phase1)
    for a, b in zip(phase2[::2], phase2[1::2]):
        assert not a["committed"] and len(a["remasked"]) == k
        assert len(b["committed"]) == k and not b["remasked"]
    assert all(1 <= len(e["committed"]) <= k and not e["remasked"] for e in phase3)
    assert res.remasks == k * loops


# ------------------------------------------------------------------------------------------------ 1. the rules


def test_wino_revokes_and_counts_as_the_authors(setup):
    P, G, B = len(setup["prompt"]), 16, 8
    fn, calls = counting(setup["masked"])
    res = R.wino_generate(fn, setup["prompt"], mask_id=setup["mask"], gen_length=G, block_length=B)
    assert res.remasks > 0
    assert res.nfe == len(calls)  # one forward pass a step, the held-out copy in the same pass
    replay(res, setup["prompt"], setup["mask"], G)
    check_wino(res, P, G, B)
    # The narrow-out cap is reached here (a pass with >= last_accept tokens below threshold_back).
    assert any(len(e["remasked"]) == len(prev["committed"]) - 1 > 0 and e["block"] == prev["block"]
               for prev, e in zip(res.log, res.log[1:]))


def test_saber_revokes_and_counts_as_the_authors(setup):
    P, G, B = len(setup["prompt"]), 16, 8
    fn, calls = counting(setup["logits"])
    res = R.saber_generate(fn, setup["prompt"], mask_id=setup["mask"], gen_length=G, block_length=B, n=2)
    assert res.remasks > 0
    assert res.nfe == len(calls)
    replay(res, setup["prompt"], setup["mask"], G)
    check_saber(res, P, G, B, n=2, mu=8)
    # mu=2 (the other stored version's default) remasks more per pass once a pass commits more than 2.
    res2 = R.saber_generate(setup["logits"], setup["prompt"], mask_id=setup["mask"], gen_length=G, block_length=B,
                            n=2, mu=2)
    replay(res2, setup["prompt"], setup["mask"], G)
    check_saber(res2, P, G, B, n=2, mu=2)


def test_remdm_revokes_and_counts_as_the_authors(setup):
    G, r, k, loops = 16, 0.875, 1, 4
    fn, calls = counting(setup["logits"])
    res = R.remdm_generate(fn, setup["prompt"], mask_id=setup["mask"], gen_length=G, init_unmask_ratio=r,
                           unmask_k=k, loop_steps=loops)
    assert res.remasks == 4 and res.nfe == len(calls) == 14 + 8 + 2
    replay(res, setup["prompt"], setup["mask"], G)
    check_remdm(res, G, r, k, loops)
    res2 = R.remdm_generate(setup["logits"], setup["prompt"], mask_id=setup["mask"], gen_length=G,
                            init_unmask_ratio=0.75, unmask_k=2, loop_steps=3)
    replay(res2, setup["prompt"], setup["mask"], G)
    check_remdm(res2, G, 0.75, 2, 3)
    with pytest.raises(ValueError):
        R.remdm_generate(setup["logits"], setup["prompt"], mask_id=setup["mask"], gen_length=G, init_unmask_ratio=0.3)


def test_rule_formulas():
    assert [R.wino_max_accept(m) for m in (1, 7, 8, 10, 28, 29, 100)] == [5, 5, 5, 7, 19, 20, 20]
    assert [R.wino_remask_count(nb, la) for nb, la in ((3, 30), (5, 5), (6, 5), (4, 5), (2, 1))] == [3, 4, 4, 4, 0]
    assert [R.saber_remask_count(2, f) for f in (2, 3, 8, 9, 17)] == [1, 1, 1, 2, 3]
    assert [R.saber_remask_count(2, f, mu=2) for f in (2, 3, 5)] == [1, 2, 3]
    assert R.saber_remask_count(1, 1) == 0 and R.saber_remask_count(4, 4) == 2
    fc = np.array([-np.inf, 0.5, 0.7, -np.inf, 0.9])
    assert R.saber_threshold(fc, np.zeros(5, bool), 3) == pytest.approx(0.6)
    assert R.saber_threshold(np.full(5, -np.inf), np.zeros(5, bool), 5) == 1.0


# ------------------------------------------------------------------------------------------------ 2. the mask


@pytest.mark.parametrize("P,G,b,B", [(8, 16, 0, 8), (8, 16, 1, 8), (5, 12, 2, 4), (3, 4, 0, 4)])
def test_wino_mask_properties(P, G, b, B):
    attn, pos = R.wino_mask(P, G, P + b * B, B)
    L, lo = P + G, P + b * B
    assert attn.shape == (1, 1, L + B, L + B) and attn.dtype == torch.bool and pos.shape == (1, L + B)
    a = attn[0, 0]
    assert a[:L, :L].all()  # the canvas is a plain bidirectional pass
    assert not a[:L, L:].any()  # no original sees the copy
    assert a[L:, L:].all()  # the copy sees the whole copy, itself included (the authors' choice)
    for k in range(B):
        row = a[L + k, :L]
        assert not row[lo + k] and int(row.sum()) == L - 1  # all originals but its own
    assert pos[0, :L].tolist() == list(range(L)) and pos[0, L:].tolist() == list(range(lo, lo + B))
    s = R.wino_mask(P, G, lo, B, copy_sees="self")[0][0, 0]
    assert torch.equal(s[L:, L:], torch.eye(B, dtype=torch.bool)) and torch.equal(s[:, :L], a[:, :L])
    with pytest.raises(ValueError):
        R.wino_mask(P, G, P + G - B + 1, B)


# ------------------------------------------------------------------------------------------------ 3. held-out


def _canvas(prompt, M, G, B, held, seed=3):
    """prompt + block 0 decoded (random ids) + block 1 with the positions `held` decoded, the rest masked."""
    P = len(prompt)
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(list(prompt) + [M] * G)
    x[P:P + B] = torch.randint(10, 250, (B,), generator=g)
    x[[P + B + k for k in held]] = torch.randint(10, 250, (len(held),), generator=g)
    return x


def _extended(mf, canvas, attn, pos, width, M):
    ids = torch.cat([canvas, torch.full((width,), M)])[None]
    return mf(ids, attn, pos)[0].double()


def test_wino_held_out_scores_one_layer(setup, tiny_tokenizer):
    """What the authors' mask implies, exactly, where it can be exact (one layer: keys and values are those
    of the tokens themselves): the canvas rows are the plain pass; with a copy that sees only itself, copy
    row k is position lo+k of a plain pass where that position holds the mask; the authors' copy (which sees
    the whole copy) equals that for a block of one only, and for longer blocks differs from it by the B-1
    other copy masks at the block's positions that it also sees, while never reading the token at lo+k."""
    from oracles.bidirectional import llama_from_llada

    tok, M = tiny_tokenizer, setup["mask"]
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id, n_layers=1)
    model = llama_from_llada(cfg, random_llada_tensors(cfg, seed=11, head_scale=20.0))
    lf, mf = R.logits_fn_from_model(model), R.masked_logits_fn_from_model(model)
    P, G, B, held = len(setup["prompt"]), 16, 8, [0, 2, 3, 6]
    L, lo = P + G, P + B
    x = _canvas(setup["prompt"], M, G, B, held)
    plain = lf(x[None])[0].double()
    attn, pos = R.wino_mask(P, G, lo, B)
    authors = _extended(mf, x, attn, pos, B, M)
    torch.testing.assert_close(authors[:L], plain, atol=1e-4, rtol=1e-4)
    own = _extended(mf, x, *R.wino_mask(P, G, lo, B, copy_sees="self"), B, M)
    torch.testing.assert_close(own[:L], plain, atol=1e-4, rtol=1e-4)
    for k in range(B):
        xk = x.clone()
        xk[lo + k] = M
        ref = lf(xk[None])[0, lo + k].double()
        torch.testing.assert_close(own[L + k], ref, atol=1e-4, rtol=1e-4)
        one = _extended(mf, x, *R.wino_mask(P, G, lo + k, 1), 1, M)  # a block of one
        torch.testing.assert_close(one[L], ref, atol=1e-4, rtol=1e-4)
    for k in held:
        xk = x.clone()
        xk[lo + k] = (int(x[lo + k]) + 17) % 250
        moved = _extended(mf, xk, attn, pos, B, M)
        torch.testing.assert_close(moved[L + k], authors[L + k], atol=1e-5, rtol=1e-5)  # never reads lo+k
        others = [L + j for j in range(B) if j != k]
        assert (moved[others] - authors[others]).abs().max() > 1e-3  # the other copy rows do
    assert (authors[L:] - own[L:]).abs().max() > 1e-3  # the documented difference: the other copy masks


def test_wino_held_out_scores_deeper_layers(setup):
    """With more layers the copy is held out at the first layer only: copy row k does not attend to lo+k,
    but from the second layer on it reads the other canvas positions, whose states saw the token at lo+k.
    So even the self-only copy is not the plain held-out pass, and the token at lo+k moves copy row k."""
    lf, mf, M = setup["logits"], setup["masked"], setup["mask"]
    P, G, B, held = len(setup["prompt"]), 16, 8, [0, 2, 3, 6]
    L, lo = P + G, P + B
    x = _canvas(setup["prompt"], M, G, B, held)
    attn, pos = R.wino_mask(P, G, lo, B)
    authors = _extended(mf, x, attn, pos, B, M)
    torch.testing.assert_close(authors[:L], lf(x[None])[0].double(), atol=1e-4, rtol=1e-4)
    own = _extended(mf, x, *R.wino_mask(P, G, lo, B, copy_sees="self"), B, M)
    k = held[0]
    xk = x.clone()
    xk[lo + k] = M
    assert (own[L + k] - lf(xk[None])[0, lo + k].double()).abs().max() > 1e-3
    xk[lo + k] = (int(x[lo + k]) + 17) % 250
    assert (_extended(mf, xk, attn, pos, B, M)[L + k] - authors[L + k]).abs().max() > 1e-3


def test_wino_narrow_out_uses_the_copy_scores(setup):
    """Narrow-out re-derived from each recorded pass: the held block tokens whose p(copy row k)[token at lo+k]
    < threshold_back are remasked, only after more than one commit, and when there are >= last_accept of
    them only the last_accept - 1 lowest (30 before a block's first pass)."""
    M, P, G, B = setup["mask"], len(setup["prompt"]), 16, 8
    seen = []

    def fn(ids, attn, pos):
        out = setup["masked"](ids, attn, pos)
        seen.append((ids[0].clone(), torch.softmax(out[0].double(), -1)))
        return out

    res = R.wino_generate(fn, setup["prompt"], mask_id=M, gen_length=G, block_length=B)
    L, capped, last = P + G, 0, {}
    for e, (ids, p) in zip(res.log, seen):
        lo = P + e["block"] * B
        la = last.get(e["block"], 30)
        back = {lo + k: float(p[L + k, ids[lo + k]]) for k in range(B) if int(ids[lo + k]) != M}
        below = sorted(back, key=lambda j: (back[j], j))
        below = [j for j in below if back[j] < 0.9]
        if len(e["committed"]) <= 1:
            expected = []
        elif len(below) < la:
            expected = below
        else:
            expected, capped = below[:la - 1], capped + 1
        assert e["remasked"] == sorted(expected), e
        last[e["block"]] = len(e["committed"])
    assert res.remasks > 0 and capped > 0


# ------------------------------------------------------------------------------------------------ 4. broken variants


def test_broken_variants_change_the_output(setup, monkeypatch):
    M, prompt, P, G, B = setup["mask"], setup["prompt"], len(setup["prompt"]), 16, 8
    lf, mf = setup["logits"], setup["masked"]

    # WINO without narrow-out's at-most limit: here it never finishes at the authors' settings, and at
    # threshold 0.5 it finishes with other tokens and breaks the counting check.
    good = R.wino_generate(mf, prompt, mask_id=M, gen_length=G, block_length=B, threshold=0.5)
    check_wino(good, P, G, B)
    with monkeypatch.context() as m:
        m.setattr(R, "wino_remask_count", lambda n_below, last_accept: n_below)
        with pytest.raises(RuntimeError):
            R.wino_generate(mf, prompt, mask_id=M, gen_length=G, block_length=B, max_passes=200)
        bad = R.wino_generate(mf, prompt, mask_id=M, gen_length=G, block_length=B, threshold=0.5, max_passes=200)
    assert bad.tokens != good.tokens
    with pytest.raises(AssertionError):
        check_wino(bad, P, G, B)

    # Saber whose threshold forgets remasked tokens (the authors never clear it): other tokens.
    good = R.saber_generate(lf, prompt, mask_id=M, gen_length=G, block_length=B)

    def cleared(final_conf, committed, end):
        seen = final_conf[:end][committed[:end] & np.isfinite(final_conf[:end])]
        return float(seen.mean()) if seen.size else 1.0

    with monkeypatch.context() as m:
        m.setattr(R, "saber_threshold", cleared)
        bad = R.saber_generate(lf, prompt, mask_id=M, gen_length=G, block_length=B)
    assert bad.tokens != good.tokens
    # Saber remasking up to n a pass instead of max(n // 2, ceil(fix / 8)): other log, failed count check.
    with monkeypatch.context() as m:
        m.setattr(R, "saber_remask_count", lambda n, fix, mu=8: min(n, fix - 1))
        bad = R.saber_generate(lf, prompt, mask_id=M, gen_length=G, block_length=B)
    assert bad.log != good.log
    with pytest.raises(AssertionError):
        check_saber(bad, P, G, B, n=2, mu=8)

    # ReMDM remasking by the argmax probability instead of the probability of the token held: other tokens.
    good = R.remdm_generate(lf, prompt, mask_id=M, gen_length=G)
    with monkeypatch.context() as m:
        m.setattr(R, "remdm_remask_score", lambda p, x, held: p[held].max(-1))
        bad = R.remdm_generate(lf, prompt, mask_id=M, gen_length=G)
    assert bad.tokens != good.tokens
