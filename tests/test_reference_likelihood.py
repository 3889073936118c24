"""oracles.likelihood: the PyTorch transcription of LLaDA's and Dream's Monte-Carlo
log-likelihood estimators, checked against re-derivations (exact rationals, deterministic cases, exact
expectations by enumeration) on tiny random models."""

from __future__ import annotations

import math
import statistics
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from helpers import random_dream_tensors, random_llada_tensors, tiny_dream_config, tiny_hf_config
from oracles import likelihood as rl
from oracles import bidirectional as reference_torch


@pytest.fixture(scope="module")
def llada(tiny_tokenizer):
    """(logits_fn, mask_id): a 2-layer random LLaDA run as Llama, sharpened so probabilities spread."""
    tok = tiny_tokenizer
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id, n_layers=2)
    model = reference_torch.llama_from_llada(cfg, random_llada_tensors(cfg, seed=3, head_scale=10.0))
    return (lambda ids: reference_torch.bidirectional_logits(model, ids)), tok.mask_token_id


@pytest.fixture(scope="module")
def dream(dream_tokenizer):
    """(logits_fn, mask_id, eos_id): a 2-layer random Dream run as Qwen2 (raw, unshifted logits)."""
    tok = dream_tokenizer
    cfg = tiny_dream_config(320, tok.mask_token_id, tok.eos_token_id, num_hidden_layers=2)
    model = reference_torch.qwen2_from_dream(cfg, random_dream_tensors(cfg, seed=4, head_scale=10.0))
    return (lambda ids: reference_torch.bidirectional_logits(model, ids)), tok.mask_token_id, tok.eos_token_id


def _rowwise(fn):
    """The same model run one row at a time: its logits then do not depend on what else is in the batch (float32
    matmuls over a batch of several rows may round differently), so deterministic identities hold exactly."""
    return lambda ids: torch.cat([fn(ids[i:i + 1]) for i in range(ids.shape[0])])


def _ce(logits: torch.Tensor, token: int) -> float:
    """Cross-entropy of one token under one logits row [V], float64."""
    return float(-torch.log_softmax(logits.double(), -1)[token])


# ---------------------------------------------------------------- 1. stratified counts


def _round_half_even(q: Fraction) -> int:
    f = math.floor(q)
    r = q - f
    return f + (1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and f % 2 == 1) else 0)


def _exact_counts(k: int, L: int, b: int) -> list[int]:
    return [(_round_half_even(k + Fraction(i * L, b)) - 1) % L + 1 for i in range(b)]


def test_stratified_counts_match_exact_rationals():
    checked = ties = 0
    for b in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32):
        for L in range(1, 71):
            for k in range(1, L + 1):
                got, want = rl.llada_stratified_counts(k, L, b), _exact_counts(k, L, b)
                assert len(got) == b and all(1 <= c <= L for c in got)
                checked += 1
                if b & (b - 1) == 0:  # power of two: the float32 grid is exact, so is the count
                    assert got == want, (k, L, b)
                    continue
                for i, (g, w) in enumerate(zip(got, want)):  # otherwise only exact .5 ties may land either side
                    if g != w:
                        q = k + Fraction(i * L, b)
                        assert q - math.floor(q) == Fraction(1, 2), (k, L, b, i)
                        assert g in ((math.floor(q) - 1) % L + 1, math.floor(q) % L + 1)
                        ties += 1
    assert checked > 10000 and ties > 0  # the tie branch is exercised (b = 6, 12, 24)
    # the counts are stratified: for b = L they are a permutation of 1..L
    assert sorted(rl.llada_stratified_counts(3, 32, 32)) == list(range(1, 33))


def test_llada_forward_process_masks_exactly_the_counts():
    g = torch.Generator().manual_seed(0)
    prompt, L, b, mask_id = 3, 7, 32, 2
    batch = torch.arange(10, 10 + prompt + L)[None].repeat(b, 1)
    for _ in range(20):
        noisy, p_mask = rl.llada_forward_process(batch, prompt, mask_id, g)
        masked = noisy == mask_id
        assert not masked[:, :prompt].any()
        n = masked.sum(1)
        k = int(n[0])
        assert n.tolist() == rl.llada_stratified_counts(k, L, b)  # row 0 carries l_0 = k itself
        assert torch.equal(p_mask, (n.float() / L)[:, None].expand(b, prompt + L))
        assert torch.equal(noisy[~masked], batch[~masked])


def test_dream_forward_process_never_masks_the_ends():
    g = torch.Generator().manual_seed(0)
    batch = torch.arange(5, 17)[None].repeat(16, 1)
    noisy, p_mask = rl.dream_forward_process(batch, 99, g, sampling_eps=1e-3)
    assert not (noisy[:, [0, -1]] == 99).any()
    p = p_mask[:, 0]
    t = (p - 1e-3) / (1 - 1e-3)
    steps = (t - t[0]) % 1  # t_i = (u0 + i / b) mod 1
    assert torch.allclose(steps, torch.arange(16) / 16, atol=1e-5)
    noisy, _ = rl.dream_forward_process(batch, 99, g, sampling_eps=1.0)  # p = 1: every inner position
    assert (noisy[:, 1:-1] == 99).all() and torch.equal(noisy[:, [0, -1]], batch[:, [0, -1]])


# ---------------------------------------------------------------- 2. deterministic cases


@pytest.mark.parametrize("cfg", [0.0, 1.5])
def test_llada_one_token_target_is_minus_ce(llada, cfg):
    batched, mask_id = llada
    fn = _rowwise(batched)
    prefix, target = [20, 31, 45, 60], [77]
    cond = fn(torch.tensor([prefix + [mask_id]]))[0, -1].float()
    if cfg > 0:
        un = fn(torch.tensor([[mask_id] * (len(prefix) + 1)]))[0, -1].float()
        cond = un + (cfg + 1) * (cond - un)
    ce = float(F.cross_entropy(cond[None], torch.tensor(target)))
    one = rl.llada_loglikelihood(fn, prefix, target, mask_id=mask_id, mc_num=4, batch_size=1, cfg=cfg)
    assert one == -ce
    full = rl.llada_loglikelihood(batched, prefix, target, mask_id=mask_id, mc_num=64, batch_size=32, cfg=cfg,
                                  generator=torch.Generator().manual_seed(1))
    assert full == pytest.approx(-ce, rel=1e-5)  # 32 equal rows of a batched forward summed in float32, / 32
    exp = rl.llada_expected_loglikelihood(fn, prefix, target, mask_id=mask_id, cfg=cfg)
    assert exp == pytest.approx(-ce, rel=1e-6)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_dream_deterministic_cases(dream, guidance):
    fn, mask_id, eos = dream
    fn = _rowwise(fn)
    prefix = [10, 20, 30]

    def shifted(ids):  # Dream's shift: position j reads the model's output at j - 1
        raw = fn(torch.tensor([ids]))[0]
        return torch.cat([raw[:1], raw[:-1]])

    def guided(ids):
        out = shifted(ids).double()
        if guidance > 1:
            un = shifted([mask_id] * len(prefix) + ids[len(prefix):]).double()
            out = un + guidance * (out - un)
        return out

    # one token + EOS: the single maskable position has weight 1/p and mask probability p: E = -CE
    ce = _ce(guided(prefix + [mask_id, eos])[len(prefix)], 40)
    exp = rl.dream_expected_loglikelihood(fn, prefix, [40, eos], mask_id=mask_id, classifier_free_guidance=guidance)
    assert exp == pytest.approx(-ce, rel=1e-12)
    # sampling_eps = 1: p = 1, every maskable target position is masked in every row: -(sum of their CE)
    target = [40, 41, 42, eos]
    lg = guided(prefix + [mask_id] * 3 + [eos])
    ce_all = sum(_ce(lg[len(prefix) + j], target[j]) for j in range(3))
    mc = rl.dream_loglikelihood(fn, prefix, target, mask_id=mask_id, mc_num=16, batch_size=8,
                                classifier_free_guidance=guidance, sampling_eps=1.0)
    assert mc == pytest.approx(-ce_all, rel=1e-5)
    assert rl.dream_expected_loglikelihood(fn, prefix, target, mask_id=mask_id, classifier_free_guidance=guidance,
                                           sampling_eps=1.0) == pytest.approx(-ce_all, rel=1e-12)
    # empty prefix: position 0 is never masked, so [token, EOS] has nothing to score
    assert rl.dream_loglikelihood(fn, [], [40, eos], mask_id=mask_id, mc_num=8, batch_size=8) == 0.0
    assert rl.dream_expected_loglikelihood(fn, [], [40, eos], mask_id=mask_id) == 0.0


def test_dream_weights_integrate_exactly():
    eps = 1e-3
    for n in range(1, 8):
        for m in range(1, n + 1):
            # (1/(1-eps)) int_eps^1 p^(m-1) (1-p)^(n-m) dp; at eps -> 0 it is the Beta function B(m, n-m+1)
            w = rl._dream_weight(m, n, eps)
            beta = math.gamma(m) * math.gamma(n - m + 1) / math.gamma(n + 1)
            assert w == pytest.approx(beta, rel=0.02)
            assert rl._dream_weight(m, n, 0.0) == pytest.approx(beta, rel=1e-12)
    # sum over subsets of p^|M| (1-p)^(n-|M|) |M| / p = n for every p: the weights of S(M) = |M| give n
    n = 6
    assert sum(math.comb(n, m) * m * rl._dream_weight(m, n, eps) for m in range(1, n + 1)) == pytest.approx(n)


# ---------------------------------------------------------------- 3. unbiasedness


def _within_4se(losses: list[float], expected: float) -> None:
    mean = -statistics.fmean(losses)
    se = statistics.stdev(losses) / math.sqrt(len(losses))
    assert se > 0
    assert abs(mean - expected) < 4 * se, (mean, expected, se)


@pytest.mark.parametrize("cfg", [0.0, 1.0])
def test_llada_estimator_is_unbiased(llada, cfg):
    fn, mask_id = llada
    prefix, target = [20, 31, 45], [77, 81, 90, 101]
    g = torch.Generator().manual_seed(123)
    losses = rl.llada_minibatch_losses(fn, prefix, target, mask_id=mask_id, mc_num=960, batch_size=8, cfg=cfg,
                                       generator=g)
    assert len(losses) == 120
    exp = rl.llada_expected_loglikelihood(fn, prefix, target, mask_id=mask_id, batch_size=8, cfg=cfg)
    _within_4se(losses, exp)
    # the public estimate is minus the mean of the same mini-batch losses (same draws from the same seed)
    few = rl.llada_minibatch_losses(fn, prefix, target, mask_id=mask_id, mc_num=32, batch_size=8, cfg=cfg,
                                    generator=torch.Generator().manual_seed(123))
    ll = rl.llada_loglikelihood(fn, prefix, target, mask_id=mask_id, mc_num=32, batch_size=8, cfg=cfg,
                                generator=torch.Generator().manual_seed(123))
    assert ll == -sum(few) / len(few)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_dream_estimator_is_unbiased(dream, guidance):
    fn, mask_id, eos = dream
    prefix, target = [10, 20, 30], [40, 41, 42, 43, eos]
    g = torch.Generator().manual_seed(7)
    losses = rl.dream_minibatch_losses(fn, prefix, target, mask_id=mask_id, mc_num=960, batch_size=8,
                                       classifier_free_guidance=guidance, generator=g)
    exp = rl.dream_expected_loglikelihood(fn, prefix, target, mask_id=mask_id, classifier_free_guidance=guidance)
    _within_4se(losses, exp)
    few = rl.dream_minibatch_losses(fn, prefix, target, mask_id=mask_id, mc_num=32, batch_size=8,
                                    classifier_free_guidance=guidance, generator=torch.Generator().manual_seed(7))
    ll = rl.dream_loglikelihood(fn, prefix, target, mask_id=mask_id, mc_num=32, batch_size=8,
                                classifier_free_guidance=guidance, generator=torch.Generator().manual_seed(7))
    assert ll == -(sum(few) / len(few))


def test_expectations_detect_a_wrong_model(llada, dream):
    """The 4-standard-error check has power: estimates from another model (here: the target shifted) land far
    outside it, so the unbiasedness tests above would catch a mis-weighted or mis-masked estimator."""
    fn, mask_id = llada
    prefix, target = [20, 31, 45], [77, 81, 90, 101]
    exp = rl.llada_expected_loglikelihood(fn, prefix, target, mask_id=mask_id, batch_size=8)
    other = rl.llada_expected_loglikelihood(fn, prefix, [78, 81, 90, 101], mask_id=mask_id, batch_size=8)
    losses = rl.llada_minibatch_losses(fn, prefix, target, mask_id=mask_id, mc_num=800, batch_size=8,
                                       generator=torch.Generator().manual_seed(5))
    se = statistics.stdev(losses) / math.sqrt(len(losses))
    assert abs(other - exp) > 4 * se
    dfn, dmask, eos = dream
    a = rl.dream_expected_loglikelihood(dfn, [10, 20, 30], [40, 41, 42, eos], mask_id=dmask)
    b = rl.dream_expected_loglikelihood(dfn, [10, 20, 30], [40, 41, 42, eos], mask_id=dmask, sampling_eps=0.5)
    assert a != pytest.approx(b, rel=1e-3)  # the eps-dependence of the weights is visible


# ---------------------------------------------------------------- 4. encoding


def test_llada_encode_pair(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = lambda s: tok(s)["input_ids"]  # noqa: E731
    ctx, cont = rl.llada_encode_pair(tok, "Question: Mia has 3 apples.  ", "She buys 4 more.")
    assert ctx == ids("Question: Mia has 3 apples.")
    whole = ids("Question: Mia has 3 apples.  She buys 4 more.")
    assert ctx + cont == whole and cont == whole[len(ctx):]
    assert tok.decode(cont).startswith("  She")  # the spaces moved to the continuation
    ctx2, cont2 = rl.llada_encode_pair(tok, "Answer:", " 7")
    assert ctx2 == ids("Answer:") and cont2 == ids("Answer: 7")[len(ctx2):]


def test_dream_encode_pair(dream_tokenizer, tiny_tokenizer):
    tok = dream_tokenizer
    ctx, cont = rl.dream_encode_pair(tok, "Tom has 9 pens ", "and gives 2 away.")
    assert ctx == tok.encode("Tom has 9 pens")
    assert cont[-1] == tok.eos_token_id
    assert ctx + cont == tok.encode("Tom has 9 pens and gives 2 away.") + [tok.eos_token_id]
    with pytest.raises(ValueError):  # Dream's tokenizer has no bos token
        rl.dream_encode_pair(tok, "Tom", " has", add_bos_token=True)
    ctx_b, cont_b = rl.dream_encode_pair(tiny_tokenizer, "Tom", " has", add_bos_token=True)
    assert ctx_b[0] == tiny_tokenizer.bos_token_id and cont_b[-1] == tiny_tokenizer.eos_token_id


# ---------------------------------------------------------------- 5. suffix greedy


def _greedy_fill(fn, prefix, n, mask_id, cfg):
    """An independent re-derivation of LLaDA's greedy check: n times, unmask the masked position whose argmax
    is most probable (leftmost on ties) with its argmax."""
    seq = list(prefix) + [mask_id] * n
    for _ in range(n):
        ids = torch.tensor([seq])
        lg = fn(ids)[0].float()
        if cfg > 0:
            un = fn(torch.tensor([[mask_id] * len(prefix) + seq[len(prefix):]]))[0].float()
            lg = un + (cfg + 1) * (lg - un)
        best = None
        for j in range(len(seq)):
            if seq[j] != mask_id:
                continue
            p = torch.softmax(lg[j], -1)
            conf, tok = float(p.max()), int(lg[j].argmax())
            if best is None or conf > best[0]:
                best = (conf, j, tok)
        seq[best[1]] = best[2]
    return seq[len(prefix):]


@pytest.mark.parametrize("cfg", [0.0, 0.5])
def test_llada_suffix_greedy(llada, cfg):
    fn, mask_id = llada
    prefix = [20, 31, 45, 60, 12]
    target = _greedy_fill(fn, prefix, 5, mask_id, cfg)
    assert mask_id not in target
    assert rl.llada_suffix_greedy(fn, prefix, target, mask_id=mask_id, cfg=cfg)
    for j in (0, 4):
        wrong = list(target)
        wrong[j] = 100 if wrong[j] != 100 else 101
        assert not rl.llada_suffix_greedy(fn, prefix, wrong, mask_id=mask_id, cfg=cfg)
