"""The eager transcriptions of the field's caches (oracles.field_caches) are right: hand-worked schedules and
pieces, degenerate settings equal to an existing oracle (Fast-dLLM's loops on transformers' Llama), and cases where
each cache really changes the tokens (so comparing the compiled policies against them decides something).

Their agreement with the authors' own code (dLLM-Cache's hooks, dKV-Cache's generate, d2Cache's vanilla_generate,
dInfer's VicinityCacheDiffusionLLM) was measured outside the suite (see oracles/field_caches/__init__.py).
"""

import pytest
import torch

from helpers import random_llada_tensors, tiny_hf_config
from oracles import bidirectional as reference_torch
from oracles import fast_dllm
from oracles import field_caches as fc
from oracles.field_caches import d2cache_loop as d2
from oracles.field_caches import dllm_cache_loop as dl
from oracles.field_caches.common import num_transfer_tokens

V, MASK, EOS = 300, 299, 1
G, T = 32, 8


@pytest.fixture(scope="module")
def model():
    """(hf_config, tensors, EagerLLaDA): 3 layers, d_model 64, a sharp head (confidences spread over (0, 1))."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and much faster on a shared CPU
    cfg = tiny_hf_config(V, MASK, EOS)
    tensors = random_llada_tensors(cfg, seed=0, head_scale=20.0)
    yield cfg, tensors, fc.EagerLLaDA(cfg, tensors)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def twin(model):
    """transformers' LlamaForCausalLM holding the same weights (the independent network)."""
    cfg, tensors, _ = model
    return reference_torch.llama_from_llada(cfg, tensors)


def prompt(i: int, length: int = 12) -> torch.Tensor:
    return torch.randint(2, 290, (length,), generator=torch.Generator().manual_seed(100 + i))


def settings(rule, block_length=T):
    return dict(gen_length=G, block_length=block_length, mask_id=MASK, rule=rule)


def decoded_at_inputs(log, P):
    """Per pass, the canvas positions decoded at its input, from the log's commits (prompt, then every commit)."""
    decoded, out = set(range(P)), []
    for p in log:
        out.append(set(decoded))
        decoded |= set(p.commits)
    return out


# ------------------------------------------------------------------------------------------------ the network


def test_the_eager_network_is_transformers_llama(model, twin):
    """Logits of the per-layer LLaDA equal transformers' Llama bidirectionally, also with a left-padded row (masked
    keys, positions counting real tokens); running a subset of positions over a full pass's keys/values gives the
    full pass's logits at those positions, and head probabilities that sum to one."""
    _, _, net = model
    ids = torch.stack([prompt(0, 20), prompt(1, 20)])
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :5] = False
    want = reference_torch.bidirectional_logits(twin, ids, mask)
    for r in range(2):
        got = net.logits(ids[r], mask[r])
        torch.testing.assert_close(got[mask[r]], want[r][mask[r]], atol=1e-4, rtol=0)  # measured: 1.7e-5
    full = net.run(ids[0])
    queries = torch.tensor([1, 4, 5, 17])
    part = net.run(ids[0], queries, list(zip(full.keys, full.values)), with_probs=True)
    torch.testing.assert_close(part.logits, full.logits[queries], atol=1e-5, rtol=0)
    assert part.probs[0].shape == (4, 4, 20)
    torch.testing.assert_close(part.probs[2].sum(-1), torch.ones(4, 4))


@pytest.mark.parametrize("rule, steps", [(fc.Threshold(0.9), None), (fc.LowConfidence(32), 32)])
def test_the_loop_without_a_cache_is_fast_dllm_generate(model, twin, rule, steps):
    """The loops' plumbing (canvas, blocks, the commit rules) equals Fast-dLLM's `generate` on the Llama twin."""
    _, _, net = model
    for i in (0, 1):
        mine = fc.no_cache(net, prompt(i), **settings(rule))
        theirs = fast_dllm.generate(twin, prompt(i)[None], gen_length=G, block_length=T, mask_id=MASK,
                                    threshold=0.9 if steps is None else None, steps=steps)
        assert torch.equal(mine.x, theirs.x[0]) and mine.nfe == theirs.nfe == mine.busy_nfe, i


def test_the_commit_rules_by_hand():
    """Threshold: the top candidate always, others >= threshold; LowConfidence: LLaDA's quotas, the most confident;
    DInferThreshold: near-ties within 1e-5 of the top commit, a prediction of the mask id never."""
    assert num_transfer_tokens(10, 4) == [3, 3, 2, 2] and num_transfer_tokens(3, 4) == [1, 1, 1, 0]
    # four positions with these softmax confidences of their argmax: 0.95, 0.6, 0.95 - 5e-6, 0.97 (the mask id, 5)
    probs = torch.full((4, 6), 0.01, dtype=torch.float64)
    probs[0, 1] = 0.95
    probs[1] = torch.tensor([0.1, 0.1, 0.6, 0.1, 0.05, 0.05])
    probs[2, 4] = 0.95 - 5e-6
    probs[3, :5], probs[3, 5] = 0.0075, 0.9625 + 0.0075
    logits = (probs / probs.sum(-1, keepdim=True)).log().float()
    cand = torch.tensor([True, True, True, True])
    kw = dict(exclude_ids=(), mask_id=5)
    pred, commit = fc.Threshold(0.9).select(logits, cand, None, **kw)
    assert pred.tolist() == [1, 2, 4, 5] and commit.tolist() == [True, False, True, True]
    pred, commit = fc.Threshold(0.99).select(logits, cand, None, **kw)
    assert commit.tolist() == [False, False, False, True]  # the top only
    _, commit = fc.DInferThreshold(0.99).select(logits, cand, None, **kw)
    assert commit.tolist() == [True, False, True, False]  # the mask-id prediction is out; 2 is within 1e-5 of 0
    _, commit = fc.LowConfidence(8).select(logits, cand, 2, **kw)
    assert commit.tolist() == [True, False, False, True]
    pred, _ = fc.Threshold(0.9).select(logits, cand, None, exclude_ids=(5,), mask_id=5)
    assert pred[3] != 5


# ------------------------------------------------------------------------------------------------ dLLM-Cache


def test_dllm_cache_schedule_counts_passes_over_the_whole_generation(model):
    """Kp=5, Kr=3: pass n refreshes the prompt when (n-1) % 5 == 0 and the response when (n-1) % 3 == 0, the count
    running on across blocks (block changes trigger nothing); layers >= 1 pick int(32 * 0.25) = 8 response
    positions by value similarity exactly when the response is not refreshed, layer 0 never picks (it runs all)."""
    _, _, net = model
    out = fc.dllm_cache(net, prompt(0), **settings(fc.Threshold(0.9)), prompt_interval=5, gen_interval=3,
                        transfer_ratio=0.25)
    by_hand = ["full", "cached", "cached", "response", "cached", "prompt", "response", "cached", "cached",
               "response", "prompt", "cached", "response", "cached", "cached", "full"]
    kinds = [p.kind for p in out.log]
    assert len(kinds) >= 16 and kinds[:16] == by_hand
    assert [p.detail["pass"] for p in out.log] == list(range(1, out.nfe + 1))
    starts = [p for p in out.log if p.step == 0 and p.block > 0]
    assert len(starts) == 3 and any(p.kind == "cached" for p in starts)  # a block starting on a cached pass
    P = 12
    for p in out.log:
        assert p.detail["picked"][0] == ()
        for layer_picks in p.detail["picked"][1:]:
            assert len(layer_picks) == (0 if p.detail["refresh_response"] else 8)
            assert all(P <= j < P + G for j in layer_picks)
        assert set(p.queries) == (set(range(P)) if p.detail["refresh_prompt"] else set()) | (
            set(range(P, P + G)) if p.detail["refresh_response"] else set())


def test_dllm_cache_layer_reuses_kept_outputs_and_recomputes_the_least_similar(model):
    """One layer under the hook, worked by hand with the network's pieces: after a full refresh on inputs h_a, a
    pass on h_b (every row nudged, two response rows replaced) refreshes nothing, rho = 0.25 of G = 8 -> 2 picks:
    exactly the two replaced rows (their fresh values are the least similar). Unpicked rows (prompt included) add
    the KEPT attention and FFN outputs to their new input; picked rows get a fresh query over the kept prompt keys,
    the kept response keys with theirs replaced, and every response value fresh (the nudge makes them all new)."""
    _, _, net = model
    P, Gs, layer = 4, 8, 1
    g = torch.Generator().manual_seed(3)
    h_a = torch.randn(P + Gs, 64, generator=g)
    kept = dl.Kept()
    dl.cached_layer(net, layer, h_a, kept, P, True, True, 0.25)
    a_attn = torch.cat([kept.p_attn, kept.r_attn]).clone()
    a_ffn = torch.cat([kept.p_ffn, kept.r_ffn]).clone()
    a_k, a_v = torch.cat([kept.p_k, kept.r_k]).clone(), torch.cat([kept.p_v, kept.r_v]).clone()
    changed = [P + 1, P + 5]
    h_b = h_a + 0.05 * torch.randn(P + Gs, 64, generator=g)
    h_b[changed] = torch.randn(2, 64, generator=g)
    out, picked = dl.cached_layer(net, layer, h_b, kept, P, False, False, 0.25)
    assert sorted(P + int(j) for j in picked) == changed
    lay = net.layers[layer]
    hn = lay.attn_norm(h_b)
    keys, values = a_k.clone(), a_v.clone()
    keys[changed] = lay.k(hn[changed])
    values[P:] = lay.v(hn[P:])
    attn_fresh, _ = net.attend(layer, lay.q(hn[changed]), torch.tensor(changed), keys, torch.arange(P + Gs), values)
    h2 = h_b[changed] + attn_fresh
    torch.testing.assert_close(out[changed], h2 + lay.ffn(h2), atol=1e-5, rtol=0)
    others = [j for j in range(P + Gs) if j not in changed]
    torch.testing.assert_close(out[others], h_b[others] + a_attn[others] + a_ffn[others], atol=1e-5, rtol=0)
    # the case decides: a full recompute of the unchanged rows differs (their attention sees the changed rows)
    full = h_b + net.attend(layer, lay.q(hn), torch.arange(P + Gs), lay.k(hn), torch.arange(P + Gs), lay.v(hn))[0]
    full = full + lay.ffn(full)
    assert (full[others] - out[others]).abs().max() > 1e-3


def test_dllm_cache_recomputes_layer_0_and_adds_kept_outputs_to_the_residual(model):
    """Intervals longer than the generation and rho 0: after pass 1 every pass is, by hand, layer 0 run in full on
    the current canvas, then each later layer adding pass 1's kept attention and FFN outputs to the residual stream.
    That loop, written here with the network's pieces, gives the oracle's tokens and NFE; keeping layer 0 too (the
    authors' code before "enforcing layer_id==0 refresh all") gives other tokens, so the case decides."""
    _, _, net = model
    rule = fc.Threshold(0.9)
    out = fc.dllm_cache(net, prompt(0), **settings(rule), prompt_interval=1000, gen_interval=1000, transfer_ratio=0.0)

    def by_hand(layer0_kept: bool):
        x = torch.cat([prompt(0), torch.full((G,), MASK)])
        kept, nfe = None, 0
        for b in range(G // T):
            lo, hi = 12 + b * T, 12 + (b + 1) * T
            while (x[lo:hi] == MASK).any():
                h = net.embed(x)
                outputs = []
                for i, lay in enumerate(net.layers):
                    if kept is None or (i == 0 and not layer0_kept):
                        hn, pos = lay.attn_norm(h), torch.arange(len(x))
                        attn = net.attend(i, lay.q(hn), pos, lay.k(hn), pos, lay.v(hn))[0]
                        ffn = lay.ffn(h + attn)
                    else:
                        attn, ffn = kept[i]
                    outputs.append((attn, ffn))
                    h = h + attn + ffn
                kept = kept or outputs
                nfe += 1
                pred, commit = rule.select(net.head(h)[lo:hi], x[lo:hi] == MASK, None, exclude_ids=(), mask_id=MASK)
                x[lo:hi] = torch.where(commit & (x[lo:hi] == MASK), pred, x[lo:hi])
        return x, nfe

    x, nfe = by_hand(layer0_kept=False)
    assert torch.equal(out.x, x) and out.nfe == nfe
    assert not torch.equal(by_hand(layer0_kept=True)[0], x)


@pytest.mark.parametrize("rule", [fc.Threshold(0.9), fc.LowConfidence.dllm_cache(32)])
def test_dllm_cache_without_intervals_is_no_cache_and_with_them_changes_tokens(model, rule):
    """Intervals 1: every pass refreshes everything (the similarity picks never run): the loop without a cache, same
    tokens and NFE. The check's settings change the tokens (and keep the NFE for LLaDA's schedule)."""
    _, _, net = model
    base = fc.no_cache(net, prompt(0), **settings(rule))
    same = fc.dllm_cache(net, prompt(0), **settings(rule), prompt_interval=1, gen_interval=1, transfer_ratio=0.25)
    assert torch.equal(same.x, base.x) and same.nfe == base.nfe and {p.kind for p in same.log} == {"full"}
    for Kp, Kr, rho in ((5, 3, 0.25), (4, 2, 0.0)):
        out = fc.dllm_cache(net, prompt(0), **settings(rule), prompt_interval=Kp, gen_interval=Kr, transfer_ratio=rho)
        assert not torch.equal(out.x, base.x), (Kp, Kr, rho)


# ------------------------------------------------------------------------------------------------ dKV-Cache


def test_dkv_first_two_passes_reload_and_delayed_caching(model):
    """LLaDA's schedule, one commit a pass, 8 passes a block, reload_every 4: per block full (nothing kept), store,
    cached, cached, reload, cached x3 (the cache dropped at each block). A cached pass i recomputes exactly the
    positions not decoded at pass i-1's input (every mask of the canvas plus pass i-1's commit) and reads the rest;
    after a keeping pass the cache holds what was decoded at its input."""
    _, _, net = model
    P = 12
    out = fc.dkv(net, prompt(1), **settings(fc.LowConfidence(32)), reload_every=4)
    per_block = ["full", "store", "cached", "cached", "reload", "cached", "cached", "cached"]
    assert [p.kind for p in out.log] == per_block * 4 and out.nfe == 32
    decoded = decoded_at_inputs(out.log, P)
    everything = set(range(P + G))
    for i, p in enumerate(out.log):
        assert len(p.commits) == 1
        if p.kind == "cached":
            assert set(p.queries) == everything - decoded[i - 1]
            assert set(out.log[i - 1].commits) <= set(p.queries)  # delayed: last pass's commit recomputed
            assert set(p.detail["cached"]) == decoded[i - 1]
            assert p.block == 3 or {j for j in p.queries if j >= P + (p.block + 1) * T}  # later blocks' masks too
        else:
            assert set(p.queries) == everything and p.detail["cached"] == ()
        if p.kind != "full":
            assert set(p.detail["kept"]) == decoded[i]
        else:
            assert p.detail["kept"] == () or p.step > 0


@pytest.mark.parametrize("rule", [fc.Threshold(0.9), fc.LowConfidence(16)])
def test_dkv_reloading_every_pass_is_no_cache_and_caching_changes_tokens(model, rule):
    """reload_every 1: every pass full (the authors' default, never cached) = the loop without a cache. The check's
    settings change the tokens."""
    _, _, net = model
    base = fc.no_cache(net, prompt(0), **settings(rule))
    same = fc.dkv(net, prompt(0), **settings(rule), reload_every=1)
    assert torch.equal(same.x, base.x) and same.nfe == base.nfe and "cached" not in {p.kind for p in same.log}
    for N in (2, 4):
        out = fc.dkv(net, prompt(0), **settings(rule), reload_every=N)
        assert not torch.equal(out.x, base.x) and "cached" in {p.kind for p in out.log}, N


# ------------------------------------------------------------------------------------------------ dInfer's vicinity


def _kinds(log):
    return [(p.block, p.kind, p.busy) for p in log]


def test_vicinity_warmup_then_a_double_refresh_when_the_first_cache_is_built_after_block_0(model):
    """One commit a decode (LLaDA's schedule, 8 a block), warmup 10: block 0 is 8 warmup passes, block 1 two more,
    then the first cache (refresh + window) and, the manager not having been asked then, a second refresh at the
    next iteration; afterwards one refresh per block. Windows span [start - 0, end + 8)."""
    _, _, net = model
    P = 12
    out = fc.vicinity(net, prompt(1), **settings(fc.LowConfidence(32)), prefix_look=0, after_look=8, warmup=10)
    W, R, U = "window", "refresh", "warmup"
    by_hand = ([(0, U, True)] * 8 + [(1, U, True)] * 2 + [(1, R, True), (1, W, True), (1, R, True)]
               + [(1, W, True)] * 3 + [(2, R, True)] + [(2, W, True)] * 7 + [(3, R, True)] + [(3, W, True)] * 7)
    assert _kinds(out.log) == by_hand and out.nfe == out.busy_nfe == 32
    assert [p.detail["iter_no"] for p in out.log] == list(range(32))
    for p in out.log:
        lo = P + p.block * T
        want = range(lo, min(P + G, lo + T + 8)) if p.kind == W else range(P + G)
        assert p.queries == tuple(want)


def test_vicinity_never_refreshes_periodically_in_block_0_and_windows_follow_a_filling_refresh(model):
    """Warmup 0, refresh_every 3, one commit a decode: block 0 refreshes once (iter 0) though iter 3 and 6 are due;
    later blocks refresh at the block change and when iter_no % 3 == 0, and when such a refresh fills the block the
    window pass still runs (on a full block: counted in nfe, not in busy_nfe)."""
    _, _, net = model
    out = fc.vicinity(net, prompt(1), **settings(fc.LowConfidence(32)), prefix_look=4, after_look=4, warmup=0,
                      refresh_every=3)
    W, R = "window", "refresh"

    def later_block(b):
        return ([(b, R, True), (b, W, True), (b, W, True), (b, W, True), (b, R, True), (b, W, True), (b, W, True),
                 (b, R, True), (b, W, False)])

    by_hand = [(0, R, True)] + [(0, W, True)] * 7 + later_block(1) + later_block(2) + later_block(3)
    assert _kinds(out.log) == by_hand and (out.nfe, out.busy_nfe) == (35, 32)
    refresh_iters = [p.detail["iter_no"] for p in out.log if p.kind == R]
    assert refresh_iters == [0, 8, 12, 15, 17, 21, 24, 26, 30, 33]


def test_vicinity_without_looks_is_fast_dllm_dual_cache_and_with_them_changes_tokens(model, twin):
    """prefix_look = after_look = 0, no warmup, refresh at block changes: Fast-dLLM's dual cache (on the Llama twin),
    same tokens, and its NFE once the window passes on a full block are left out (at threshold 0.7 some refresh
    passes fill their block: measured on prompts 1 and 2, so nfe is larger). The authors' benchmark looks change
    the tokens."""
    _, _, net = model
    extra = 0
    for i in (0, 1, 2):
        mine = fc.vicinity(net, prompt(i), **settings(fc.Threshold(0.7)), prefix_look=0, after_look=0, warmup=0)
        dual = fast_dllm.generate_with_dual_cache(twin, prompt(i)[None], gen_length=G, block_length=T, mask_id=MASK,
                                                  threshold=0.7)
        assert torch.equal(mine.x, dual.x[0]) and mine.busy_nfe == dual.nfe, i
        extra += mine.nfe - mine.busy_nfe
    assert extra > 0
    base = fc.no_cache(net, prompt(0), **settings(fc.Threshold(0.9)))
    out = fc.vicinity(net, prompt(0), **settings(fc.Threshold(0.9)))
    assert not torch.equal(out.x, base.x)


# ------------------------------------------------------------------------------------------------ d2Cache


def test_d2cache_density_nucleus_inflation_and_rollout_by_hand():
    """The certainty density equals its direct sum (left of the region decoded, right of it decoded iff the last
    position is, divided by the kernel's mass over all 6G offsets); the nucleus keeps shares of the unpicked total
    up to p and at least one; inflation fills gaps of at most w between picks only; one rollout layer replaces the
    queries' rows by the head mean, adds the identity and normalises rows."""
    for decoded in ([1, 1, 0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 1, 0, 1, 1]):
        d = torch.tensor(decoded, dtype=torch.bool)
        Gs, sigma = len(decoded), 3.0
        right = 1.0 if decoded[-1] else 0.0
        ind = {j: 1.0 for j in range(-Gs, 0)} | {j: float(decoded[j]) for j in range(Gs)} | {
            j: right for j in range(Gs, 2 * Gs)}
        kernel = lambda r: torch.exp(torch.tensor(-(r ** 2) / (2 * sigma ** 2), dtype=torch.float64))  # noqa: E731
        mass = sum(kernel(r) for r in range(-3 * Gs, 3 * Gs))
        direct = torch.stack([sum(v * kernel(i - j) for j, v in ind.items()) / mass for i in range(Gs)])
        torch.testing.assert_close(d2.certainty_density(d, sigma).double(), direct, atol=2e-6, rtol=0)
    importance = torch.tensor([0.5, 3.0, 1.0, 1.0, 1.0, 9.0])
    allowed = torch.tensor([True, True, True, True, True, False])  # 5 is picked already: not in the total (6.5)
    assert d2.nucleus(importance, 0.5, allowed).tolist() == [False, True, False, False, False, False]  # 0.46
    assert d2.nucleus(importance, 0.7, allowed).tolist() == [False, True, True, False, False, False]  # 0.62
    assert d2.nucleus(importance, 0.01, allowed).sum() == 1  # at least the top one
    picked = torch.tensor([False, True, False, False, True, False, False, False, True, False])
    assert d2.inflate(picked, 3).tolist() == [False, True, True, True, True, False, False, False, True, False]
    assert d2.inflate(picked, 4).nonzero().flatten().tolist() == list(range(1, 9))
    probs = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], [[0.1, 0.9, 0.0], [0.0, 1.0, 0.0]]])  # [H, 2, 3]
    step = d2.rollout_step(torch.eye(3), probs, torch.tensor([0, 2]))
    want = torch.tensor([[(1 + 0.3) / 2, 0.7 / 2, 0.0], [0.0, 1.0, 0.0], [0.0, 0.5 / 2, (1 + 0.5) / 2]])
    torch.testing.assert_close(step, want)


def test_d2cache_picks_rank_the_block_first_on_the_authors_search_grid():
    """pick_queries worked by hand. G = 8, P = 2, block 0 = region [0, 4); at the pass's input the block's masks were
    region 2 and 3, the pass committed 2. current_k = 2: the 2nd remaining mask is region 4, the grid unit is the
    block's 2 masks at the input (not block_length 4), so the search runs to region 5: region 3 (the block's mask,
    whatever its score) and the better of 4 and 5, though region 6 scores highest (it is past the search end).
    Then the commit, the rollout nucleus (column sums: position 1 holds 3 / 8.5 of the unpicked importance) and
    inflation (w = 3 fills canvas 2..3 between the picks 1 and 4)."""
    P, Gs = 2, 8
    block_masked = torch.tensor([False, False, True, True, False, False, False, False])
    remaining = torch.tensor([False, False, False, True, True, True, True, True])
    conf = torch.tensor([0.9, 0.9, 0.9, 0.01, 0.5, 0.1, 1.0, 0.1])
    rollout = torch.diag(torch.tensor([0.5, 3.0, 1, 1, 1, 1, 1, 1, 1, 1]))
    picks = d2.pick_queries(P=P, block_masked=block_masked, remaining=remaining, conf_cache=conf, commits=[P + 2],
                            rollout=rollout, rollout_p=0.4, current_k=2, sigma=10.0, inflate_w=3)
    assert picks.current == (P + 3, P + 4)
    assert picks.committed == (P + 2,) and picks.rollout == (1,) and picks.inflated == (2, 3)
    assert picks.queries.nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 6]
    # with block_length as the grid unit (the reference file's reading) region 6 would have been picked
    wide = d2.pick_queries(P=P, block_masked=torch.tensor([True] * 4 + [False] * 4), remaining=remaining,
                           conf_cache=conf, commits=[P + 2], rollout=rollout, rollout_p=0.4, current_k=2, sigma=10.0,
                           inflate_w=0)
    assert wide.current == (P + 3, P + 6)


def test_d2cache_ranks_by_the_first_pass_confidence_all_generation_long(model):
    """Step 1 of every pass's picks, recomputed from the log (the block's masks at the pass's input, the masks after
    it) with the confidences of a plain forward of the initial canvas: the oracle's picks, pass after pass (the
    authors' update of the cached confidence writes into a copy)."""
    _, _, net = model
    P = 12
    out = fc.d2cache(net, prompt(0), **settings(fc.Threshold(0.9)), rollout_p=0.1, current_k=8, sigma=10.0,
                     inflate_w=4)
    x0 = torch.cat([prompt(0), torch.full((G,), MASK)])
    conf1 = torch.softmax(net.logits(x0)[P:], dim=-1).max(dim=-1).values
    decoded = decoded_at_inputs(out.log, P)
    masks_after = [set(range(P + G)) - d for d in decoded[1:]] + [set()]
    outside_block = 0
    for p, before, after in zip(out.log, decoded, masks_after):
        block_masked = torch.tensor([P + p.block * T <= P + j < P + (p.block + 1) * T and P + j not in before
                                     for j in range(G)])
        remaining = torch.tensor([P + j in after for j in range(G)])
        want = d2.pick_queries(P=P, block_masked=block_masked, remaining=remaining, conf_cache=conf1, commits=[],
                               rollout=torch.eye(P + G), rollout_p=0.0, current_k=8, sigma=10.0, inflate_w=0)
        assert p.detail["next"]["current"] == want.current
        outside_block += sum(j >= P + (p.block + 1) * T for j in want.current)
    assert outside_block > 0  # the ranking decided picks beyond the block


def test_d2cache_picking_everything_is_no_cache_and_its_defaults_change_tokens(model):
    """rollout_p 1 and an unbounded inflation pick every position every pass (checked in the log): the loop without
    a cache. The check's settings run partial passes and change the tokens."""
    _, _, net = model
    rule = fc.Threshold(0.9)
    base = fc.no_cache(net, prompt(0), **settings(rule))
    every = fc.d2cache(net, prompt(0), **settings(rule), rollout_p=1.0, current_k=32, sigma=10.0, inflate_w=10 ** 6)
    assert all(p.queries == tuple(range(12 + G)) for p in every.log)
    assert torch.equal(every.x, base.x) and every.nfe == base.nfe
    for s in (dict(rollout_p=0.1, current_k=8, sigma=10.0, inflate_w=4), dict()):
        out = fc.d2cache(net, prompt(0), **settings(rule), **s)
        assert not torch.equal(out.x, base.x) and {p.kind for p in out.log} == {"full", "partial"}, s
        assert out.log[0].kind == "full" and len(out.log[1].queries) < 12 + G


# ------------------------------------------------------------------------------------------------ batches


def test_a_left_padded_batch_equals_each_row_alone(model):
    """per_row drops each row's left padding (positions count real tokens): every cache's batch equals its rows
    decoded alone, tokens and NFE."""
    _, _, net = model
    rows = [prompt(2, 12), prompt(3, 9)]
    ids = torch.full((2, 12), EOS, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    for r, p in enumerate(rows):
        ids[r, 12 - len(p):], mask[r, 12 - len(p):] = p, True
    for name, kw in (("dllm_cache", dict(prompt_interval=5, gen_interval=3)), ("dkv", dict(reload_every=4)),
                     ("d2cache", dict(current_k=8)), ("vicinity", dict(refresh_every=3))):
        loop = fc.LOOPS[name]
        batch = fc.per_row(loop, net, ids, mask, **settings(fc.Threshold(0.9)), **kw)
        for r, p in enumerate(rows):
            alone = loop(net, p, **settings(fc.Threshold(0.9)), **kw)
            assert torch.equal(batch.x[r, 12:], alone.x[len(p):]) and batch.nfe[r] == alone.nfe, (name, r)
            assert torch.equal(batch.x[r, :12], ids[r])
