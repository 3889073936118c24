"""Fast-dLLM v2 (#38): converted from a tiny random Hugging Face checkpoint (Qwen2 tensors, model_type
Fast_dLLM_Qwen, no mask id in config.json), its logits against transformers' Qwen2 under the block-causal mask,
shifted, and decoding against the eager transcription of the authors' `batch_sample` (oracles/fast_dllm_v2.py):
sub-blocks, the store pass and its free token, both cache modes, any rule in the sub-blocks, NFE as the issue
counts it, a left-padded batch equal to each row alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

import localleap_jax as ll
from helpers import TOKENIZER_CORPUS, random_dream_tensors, tiny_dream_config, write_hf_checkpoint
from localleap_jax.families import make_tokenizer
from localleap_jax.model import forward
from oracles import fast_dllm_v2 as V2
from oracles import rules as reference_rules
from oracles.sdar import eager_rule

FP32_TOL = 4e-6  # relative to the logit scale: measured 1.6e-6 (2.2e-4 on logits of ~134, fp32 both sides)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer("fast_dllm_v2", TOKENIZER_CORPUS, vocab_size=300)


def _ids(tok):
    vocab = tok.get_vocab()
    return len(tok), vocab["|<MASK>|"], vocab["<|im_end|>"]


def _checkpoint(tmp_path_factory, tok, bd_size, head_scale):
    V, mask_id, stop_id = _ids(tok)
    cfg = tiny_dream_config(V, mask_id, stop_id, model_type="Fast_dLLM_Qwen",
                            architectures=["Fast_dLLM_QwenForCausalLM"], bd_size=bd_size)
    cfg.pop("mask_token_id")  # as released: the converter reads |<MASK>| from the tokenizer
    cfg.pop("auto_map")
    tensors = random_dream_tensors(cfg, seed=bd_size, head_scale=head_scale)
    src = write_hf_checkpoint(tmp_path_factory.mktemp("v2") / "hf", cfg, tensors, tok)
    out = tmp_path_factory.mktemp("v2") / "ck"
    from localleap_jax.convert_hf import convert
    convert(str(src), str(out), progress=False)
    torch_model = V2.fast_dllm_v2_torch_model({**cfg, "mask_token_id": mask_id},
                                              {k: v.numpy() for k, v in tensors.items()})
    return ll.load(out, dtype="float32"), torch_model, out


@pytest.fixture(scope="module", params=[8])
def v2(request, tmp_path_factory, tokenizer):
    # a head scaled up so confidences reach the thresholds and parallel commits happen
    return _checkpoint(tmp_path_factory, tokenizer, request.param, head_scale=10.0)


def _batch(V, lengths, seed, avoid):
    rng = np.random.default_rng(seed)
    L = max(lengths)
    ids, mask = np.zeros((len(lengths), L), np.int32), np.zeros((len(lengths), L), bool)
    for b, n in enumerate(lengths):
        row = rng.integers(0, V, n)
        while np.isin(row, avoid).any():
            row = np.where(np.isin(row, avoid), rng.integers(0, V, n), row)
        ids[b, L - n:], mask[b, L - n:] = row, True
    return ids, mask


def test_the_converted_config_names_the_family_block_and_mask(v2, tokenizer):
    model, _, out = v2
    V, mask_id, stop_id = _ids(tokenizer)
    c = model.config
    assert (c.family, c.block_size, c.mask_token_id, c.logits_shift, c.qkv_bias) == ("fast_dllm_v2", 8, mask_id, 1, True)
    assert json.loads((out / "config.json").read_text())["mask_token_id"] == mask_id


def test_logits_equal_qwen2_under_the_block_causal_mask_shifted_and_left_padded(v2, tokenizer):
    model, torch_model, _ = v2
    V, mask_id, _ = _ids(tokenizer)
    ids, mask = _batch(V, [19, 6, 13], seed=1, avoid=(mask_id,))
    ours = np.asarray(forward(model.params, ids, mask, model.config))
    ref = V2.block_causal_logits(torch_model, ids, mask, model.config.block_size)
    # a row's first real position is scored from padding in the reference's shift (never a scored position)
    scored = mask & np.concatenate([np.zeros((3, 1), bool), mask[:, :-1]], axis=1)
    scale = np.abs(ref[scored]).max()
    err = np.abs(ours - ref)[scored].max() / scale
    print(f"fp32 max |diff| / scale = {err:.2e} (logit scale {scale:.1f})")
    assert err <= FP32_TOL
    unshifted = V2.raw_logits(torch_model, ids, mask, model.config.block_size)  # the test can fail: no shift
    assert np.abs(ours - unshifted)[scored].max() / scale > 100 * FP32_TOL


def _authors(torch_model, prompt, *, gen, bd, sub, threshold=None, rule=None, cached, mask_id, stop_id):
    return V2.batch_sample(V2.Qwen2Runner(torch_model, bd), prompt, max_new_tokens=gen, block_size=bd,
                           small_block_size=sub, threshold=0.0 if threshold is None else threshold, mask_id=mask_id,
                           stop_token=stop_id, use_block_cache=cached, rule=rule, never_predict=(mask_id,),
                           canvas="sdar")


CASES = [  # (rule spec for ours, the eager rule, cache) ; threshold strict as theirs via a threshold just above
    ("threshold", "block"), ("threshold", "subblock"), ("localleap", "block"), ("stable", "subblock"),
]


@pytest.mark.parametrize("rule_name, cache", CASES)
def test_decoding_equals_the_authors_batch_sample(v2, tokenizer, rule_name, cache):
    """Tokens and NFE equal the authors' loop (their threshold rule, or any rule in the sub-blocks), in both cache
    modes, prompts on and off the block grid (free tokens from the prefill and from store passes); a left-padded
    batch equals each row alone."""
    model, torch_model, _ = v2
    V, mask_id, stop_id = _ids(tokenizer)
    bd, sub, gen = model.config.block_size, 4, 20
    ids, mask = _batch(V, [16, 5, 11, 8], seed=7, avoid=(mask_id, stop_id))  # 16, 8: on the grid (prefill free tokens)
    kappa = 0.5
    settings = {"threshold": {"kappa": kappa}, "localleap": {"kappa": kappa, "tau": 0.3, "radius": 1},
                "stable": {"k": 2, "c_min": 0.3}}[rule_name]
    ours_rule = ll.rule(rule_name, **settings)
    # theirs: the authors' strict threshold rule; the others through the eager rules (state reset per sub-block)
    eager = None if rule_name == "threshold" else eager_rule(reference_rules.make(rule_name, **settings))
    cfg = ll.DecodeConfig(strategy=ours_rule, gen_length=gen, block_length=bd, sub_block_length=sub, cache=cache)
    batch = ll.generate(model, ids, mask, cfg)
    stats = []
    for b in range(len(ids)):
        prompt = ids[b][mask[b]]
        ref = _authors(torch_model, prompt, gen=gen, bd=bd, sub=sub, threshold=kappa if eager is None else None,
                       rule=eager, cached=cache == "subblock", mask_id=mask_id, stop_id=stop_id)
        alone = ll.generate(model, prompt[None], None, cfg)
        ours = np.asarray(alone.tokens[0])
        n = min(len(ref.tokens), len(ours))
        np.testing.assert_array_equal(ours[:n], ref.tokens[:n])
        assert int(alone.nfe[0]) == ref.nfe, (b, int(alone.nfe[0]), ref.nfe, ref.denoise, ref.store)
        np.testing.assert_array_equal(np.asarray(batch.tokens[b, batch.prompt_length:]), ours[len(prompt):])
        assert int(batch.nfe[b]) == ref.nfe
        stats.append(ref)
    # the cases happened: free tokens (prefill and store), parallel commits, sub-block passes
    assert any(len(r.free_tokens) > r.store for r in stats) and sum(r.store for r in stats) > 0
    if rule_name != "stable":
        assert any(r.denoise < r.tokens.size - len(p) - len(r.free_tokens)
                   for r, p in zip(stats, [ids[b][mask[b]] for b in range(len(ids))]))
    if cache == "subblock":
        assert sum(r.sub_passes for r in stats) > 0


def test_the_adapter_decodes_in_sub_blocks_and_the_likelihood_is_refused(v2, tokenizer):
    """The lm-eval adapter takes the family's block and sub-blocks; a sub-block length for a family without them and
    the likelihood (the authors' scores only a target's first token: not an ELBO) are refused in one line."""
    from lm_eval.api.instance import Instance

    from localleap_jax.lm_eval import LocalLeapLM

    model, _, _ = v2
    lm = LocalLeapLM(model=model, compile_cache=False, progress=False, strategy="threshold:kappa=0.5", gen_length=16)
    assert (lm.cfg.block_length, lm.cfg.sub_blocks(model.config)) == (8, 8)  # the family's sub-block: the block here
    ctxs = ["Question: Tom has 9 pens.\nAnswer:", "Question: Mia has 3 apples and 4 more.\nAnswer:"]
    answers = lm.generate_until([Instance("generate_until", {}, (c, {"until": []}), i) for i, c in enumerate(ctxs)])
    for ctx, answer in zip(ctxs, answers):
        ids = np.asarray([model.tokenizer.encode(ctx)], np.int32)
        assert answer == model.tokenizer.decode_generated(ll.generate(model, ids, None, lm.cfg))[0]
    with pytest.raises(ll.LikelihoodError, match="not an ELBO"):
        ll.loglikelihood(model, [[5, 6]], [[7]])
    sdar = ll.load("embedded-sdar", dtype="float32")
    with pytest.raises(ll.DecodeError, match="sub-blocks are Fast-dLLM v2's"):
        ll.DecodeConfig(strategy="threshold", gen_length=16, block_length=4, sub_block_length=2).validate(sdar.config)
