"""ll.loglikelihood against the authors' estimators (oracles.likelihood, an eager PyTorch
transcription run on transformers' Llama / Qwen2 holding the same weights): exact where the estimator is
exact, unbiased against the float64 expectation over every mask set, independent of the batch a request is in,
reproducible from its seed, and refusing bad input in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import localleap_jax as ll
from oracles import likelihood as ref
from localleap_jax.likelihood import run as likelihood_run
from localleap_jax.likelihood.estimators import MaskCount, Noise
from oracles.bidirectional import bidirectional_logits, llama_from_llada, qwen2_from_dream
from localleap_jax.tokenizer import left_pad


@pytest.fixture(scope="module")
def llada(converted, hf_checkpoint):
    """(the fp32 JAX model, the same weights as transformers' Llama: ids -> logits)."""
    _, cfg, tensors = hf_checkpoint
    torch_model = llama_from_llada(cfg, tensors)
    return ll.load(converted, dtype="float32"), lambda ids: bidirectional_logits(torch_model, ids)


@pytest.fixture(scope="module")
def dream(dream_converted, dream_hf_checkpoint):
    _, cfg, tensors = dream_hf_checkpoint
    torch_model = qwen2_from_dream(cfg, tensors)
    return ll.load(dream_converted, dtype="float32"), lambda ids: bidirectional_logits(torch_model, ids)


PREFIXES = [[5, 17, 42, 9], [120, 3, 3, 250, 11, 12, 13], [77, 8]]


def mean_and_error(estimates) -> tuple[float, float]:
    a = np.asarray(estimates, np.float64)
    return float(a.mean()), float(a.std(ddof=1) / np.sqrt(len(a)))


@pytest.mark.parametrize("cfg_scale", [0.0, 0.5])
def test_a_one_token_continuation_is_exact_and_equals_the_authors_code(llada, cfg_scale):
    model, logits_fn = llada
    targets = [[61], [200], [7]]
    ours = ll.loglikelihood(model, PREFIXES, targets, ll.LikelihoodConfig(mc_num=64, batch_size=32,
                                                                           cfg_scale=cfg_scale))
    theirs = [ref.llada_loglikelihood(logits_fn, p, t, mask_id=model.config.mask_token_id, mc_num=64, batch_size=32,
                                      cfg=cfg_scale, generator=torch.Generator().manual_seed(0))
              for p, t in zip(PREFIXES, targets)]
    # one token: every sample masks it with weight 1, so both are exactly -CE (fp32 forward passes: measured at
    # most 3e-6 apart on values ~ -5)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    if cfg_scale:  # guidance really changed the numbers
        plain = ll.loglikelihood(model, PREFIXES, targets, ll.LikelihoodConfig(mc_num=32))
        assert np.min(np.abs(plain - ours)) > 1e-3


@pytest.mark.parametrize("target, cfg_scale", [([61, 200, 7, 33, 90], 0.5)])
def test_the_llada_estimate_is_unbiased(llada, target, cfg_scale, monkeypatch):
    model, logits_fn = llada
    prefix = PREFIXES[0]
    exact = ref.llada_expected_loglikelihood(logits_fn, prefix, target, mask_id=model.config.mask_token_id,
                                             batch_size=8, cfg=cfg_scale)

    def estimates():
        return [ll.loglikelihood(model, [prefix], [target], ll.LikelihoodConfig(mc_num=64, batch_size=8,
                                                                                 cfg_scale=cfg_scale, seed=s))[0]
                for s in range(16)]

    mean, error = mean_and_error(estimates())
    assert abs(mean - exact) < 4 * error, (mean, error, exact)
    assert error < 0.02 * abs(exact)  # precise enough to tell a wrong weight apart (below)

    class NoWeight(MaskCount):  # a broken variant: drops the L / l weight
        def draw(self, key, rows, place, maskable):
            noise = super().draw(key, rows, place, maskable)
            return Noise(noise.masked, noise.weight * 0 + 1)

    monkeypatch.setattr(likelihood_run, "estimator_for", lambda *a: NoWeight())
    broken, broken_error = mean_and_error(estimates())
    assert abs(broken - exact) > 8 * broken_error


@pytest.mark.parametrize("target, guidance", [([61], 1.0), ([61, 200, 7], 1.5)])
def test_the_dream_estimate_is_unbiased_and_uses_dreams_guidance(dream, target, guidance):
    model, logits_fn = dream
    prefix, target = PREFIXES[1], target + [model.config.eos_token_id]  # Dream's pairs end with EOS
    exact = ref.dream_expected_loglikelihood(logits_fn, prefix, target, mask_id=model.config.mask_token_id,
                                             classifier_free_guidance=guidance)
    estimates = [ll.loglikelihood(model, [prefix], [target],
                                  ll.LikelihoodConfig(mc_num=64, batch_size=16, cfg_scale=guidance - 1, seed=s))[0]
                 for s in range(16)]
    mean, error = mean_and_error(estimates)
    assert abs(mean - exact) < 4 * error, (mean, error, exact)
    # and the authors' own loop agrees in distribution (their torch RNG, the same model)
    theirs = ref.dream_minibatch_losses(logits_fn, prefix, target, mask_id=model.config.mask_token_id, mc_num=384,
                                        batch_size=16, classifier_free_guidance=guidance,
                                        generator=torch.Generator().manual_seed(0))
    their_mean, their_error = mean_and_error([-x for x in theirs])
    assert abs(their_mean - mean) < 4 * np.hypot(error, their_error), (their_mean, mean)


def test_a_request_alone_equals_it_inside_a_batch_of_other_lengths(llada):
    model, _ = llada
    contexts = [[5, 17], [120, 3, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [77], [8, 9, 10, 11]]
    continuations = [[61, 200, 7], [9], [30, 31, 32, 33, 34, 35, 36, 37, 38], [40, 41, 42, 43, 44]]
    lcfg = ll.LikelihoodConfig(mc_num=32, batch_size=8, cfg_scale=0.5, requests_per_call=4)
    together = ll.loglikelihood(model, contexts, continuations, lcfg)
    alone = np.array([ll.loglikelihood(model, [c], [y], ll.LikelihoodConfig(mc_num=32, batch_size=8, cfg_scale=0.5,
                                                                             requests_per_call=1))[0]
                      for c, y in zip(contexts, continuations)])
    # the case happened: in the batch every request sat in one canvas and one window, most behind left padding
    # and in a wider window than alone (its noise is drawn per continuation index, its padding hidden)
    groups = likelihood_run.make_groups(list(zip(contexts, continuations)), 4, 0)
    assert groups.shapes == [(32, 16)] and len(groups.members[0]) == 4
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-5)  # measured: 2e-6 (fp32, other shapes)
    reordered = ll.loglikelihood(model, contexts[::-1], continuations[::-1], lcfg)
    np.testing.assert_allclose(reordered[::-1], together, rtol=0, atol=1e-5)
    assert np.array_equal(ll.loglikelihood(model, contexts, continuations, lcfg), together)  # the same seed
    other = ll.loglikelihood(model, contexts, continuations, ll.LikelihoodConfig(mc_num=32, batch_size=8,
                                                                                 cfg_scale=0.5, seed=1))
    assert np.all(np.abs(other - together)[[0, 2, 3]] > 1e-4)  # a new seed, new noise (where the noise matters)


def test_the_head_runs_only_over_the_continuation_window(llada):
    import jax
    import jax.extend

    from localleap_jax.likelihood.program import Requests, mc_loglikelihood

    model, _ = llada
    T, C, V = 48, 4, model.config.embedding_size
    requests = Requests(np.full((2, T), 5, np.int32), np.ones((2, T), bool), np.array([3, 4], np.int32),
                        jax.random.split(jax.random.key(0), 2))
    jaxpr = jax.make_jaxpr(lambda d, r: mc_loglikelihood(d, r, 0.0, estimator=MaskCount(), mask_id=7, batch_size=8,
                                                         mc_batches=2, window=C, guided=False))(model.denoiser,
                                                                                                 requests)
    shapes = set()

    def walk(jx):
        for eqn in jx.eqns:
            shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jaxpr.jaxpr)
    with_vocab = {s for s in shapes if s and s[-1] == V}
    assert any(s[-2:] == (C, V) for s in with_vocab)  # the head ran on the window
    assert not any(len(s) >= 2 and s[-2] == T for s in with_vocab), with_vocab  # never over the canvas


def test_greedy_match_is_llada_suffix_greedy(llada):
    model, logits_fn = llada
    prefix = PREFIXES[1]
    L = 5
    ids, mask = left_pad([prefix], model.config.pad_token_id)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("low_confidence", steps=L), gen_length=L,
                                                        block_length=L))
    greedy = out.tokens[0, out.prompt_length:].tolist()  # one token per pass, the most confident: LLaDA's check
    changed = greedy[:2] + [(greedy[2] + 1) % 250] + greedy[3:]
    flags = ll.loglikelihood(model, [prefix, prefix], [greedy, changed], greedy=True)
    mask_id = model.config.mask_token_id
    assert flags.tolist() == [True, False]
    assert [ref.llada_suffix_greedy(logits_fn, prefix, t, mask_id=mask_id) for t in (greedy, changed)] == [True, False]


@pytest.mark.parametrize("contexts, continuations, lcfg, message", [
    (["a question"], [[5]], ll.LikelihoodConfig(), r"request 0: the context must be a list of token ids, got str"),
    ([[5]], [[]], ll.LikelihoodConfig(), r"request 0: the continuation is empty"),
    ([[5], [6]], [[7]], ll.LikelihoodConfig(), r"2 contexts but 1 continuations"),
    ([[5]], [[7, 100000]], ll.LikelihoodConfig(), r"request 0: the continuation holds ids outside \[0, 304\)"),
    ([[5] * 500], [[7] * 20], ll.LikelihoodConfig(), r"request 0: context \+ continuation \(520 tokens\) exceed"),
    ([[5]], [[[7, 8]]], ll.LikelihoodConfig(), r"request 0: the continuation must be a flat list"),
    ([[5]], [[7]], ll.LikelihoodConfig(estimator="dream"), r"estimator='dream' never scores a continuation's last"),
    ([[5]], [[7]], {"mc_num": 8}, r"must be an ll.LikelihoodConfig, got dict"),
    ([[5]], [[7, 2]], ll.LikelihoodConfig(), r"request 0: the continuation holds the mask id \(2\)"),
    (5, [[7]], ll.LikelihoodConfig(), r"contexts and continuations are lists of token-id lists"),
])
def test_bad_requests_are_refused_in_one_line(llada, contexts, continuations, lcfg, message):
    with pytest.raises(ll.LikelihoodError, match=message) as e:
        ll.loglikelihood(llada[0], contexts, continuations, lcfg)
    assert "\n" not in str(e.value)


def test_a_block_diffusion_model_is_refused_in_one_line(sdar_converted):
    with pytest.raises(ll.LikelihoodError, match="block-diffusion models"):
        ll.loglikelihood(ll.load(sdar_converted, dtype="float32"), [[5]], [[7]])


@pytest.mark.parametrize("context, continuation", [("Question: 3 + 4 =  ", "7"), ("The quick brown", " fox jumps"),
                                                   ("Mia has 3 apples.\n", "Answer: 7")])
def test_pairs_are_split_as_the_authors_split_them(tiny_tokenizer, dream_tokenizer, context, continuation):
    from localleap_jax.tokenizer import Tokenizer

    for hf, family, theirs in ((tiny_tokenizer, "llada", ref.llada_encode_pair),
                               (dream_tokenizer, "dream", ref.dream_encode_pair)):
        tok = Tokenizer(hf, mask_id=hf.mask_token_id, eos_id=hf.eos_token_id)
        ours = ll.encode_pair(tok, context, continuation, family=family)
        assert ours == theirs(hf, context, continuation)
        if context != context.rstrip():  # the context's trailing spaces went to the continuation
            assert hf.decode(ours[1]).startswith(context[len(context.rstrip()):])
    assert ll.encode_pair(tok, context, continuation, family="dream")[1][-1] == hf.eos_token_id


def test_encode_pair_names_what_it_cannot_take(tiny_tokenizer):
    """Issue #47's siblings: a bare TypeError / ValueError before; one ll.LocalLeapError line now (still a TypeError
    for a request that is not text)."""
    from localleap_jax.tokenizer import Tokenizer

    tok = Tokenizer(tiny_tokenizer, mask_id=tiny_tokenizer.mask_token_id, eos_id=tiny_tokenizer.eos_token_id)
    with pytest.raises(ll.LocalLeapError, match=r"^encode_pair takes two strings, got int and str$") as e:
        ll.encode_pair(tok, 5, "x")
    assert isinstance(e.value, TypeError)
    with pytest.raises(ll.LikelihoodError, match=r"^encode_pair: family must be one of llada, dream, .* got 'nope'$"):
        ll.encode_pair(tok, "a", "b", family="nope")
    with pytest.raises(ll.LikelihoodError, match=r"^encode_pair takes an ll.Model or its tokenizer"):
        ll.encode_pair(None, "a", "b")
    with pytest.raises(ll.LikelihoodError, match=r"^loglikelihood takes a model \(an ll.Model from ll.load\); str has "
                                                 r"no config, denoiser$"):
        ll.loglikelihood("embedded", [[5]], [[6]])
