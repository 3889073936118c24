"""SDAR block diffusion (families/sdar.py and the block grid of decode/): config, conversion, logits against
transformers' Qwen3 under SDAR's block-causal mask, and decoding against the eager transcription of SDAR's
`block_diffusion_generate` (oracles/sdar.py).

The loop never predicts the mask token nor the embedding rows past the tokenizer, which keep their share of the
softmax (confidences are probabilities over every row). SDAR's own argmax may pick the mask; on these random
weights it would, so the reference gets the same exclusion (`never_predict`).
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import localleap_jax as ll
from oracles import sdar as reference_sdar
from localleap_jax.config import ConfigError, ModelConfig
from localleap_jax.decode.canvas import grid_tail
from localleap_jax.model import forward
from localleap_jax.rules import DecodeError
from localleap_jax.families import read_config

from helpers import TOKENIZER_CORPUS, random_sdar_tensors, tiny_sdar_config, write_hf_checkpoint

ROWS = 320  # embedding rows; the tokenizer knows 300 ids (as SDAR's 151936 rows vs its tokenizer)
# fp32 against transformers' Qwen3 (eager attention, additive 4D mask): measured max |diff| 1.05e-5 (untied,
# block 4, logit scale 19) and 2.29e-5 (tied, block 8, logit scale 44; the sharp head scales the error with it)
# on a left-padded [3, 23] batch. The bound is 1e-4; the same weights attending bidirectionally are off
# by more than 100x this tolerance (asserted below).
FP32_TOL = 5e-5


@pytest.fixture(scope="module")
def sdar_tokenizer():
    from localleap_jax.families import make_tokenizer

    return make_tokenizer("sdar", TOKENIZER_CORPUS, vocab_size=300)


def _build(tmp_path_factory, tok, name, **overrides):
    cfg = tiny_sdar_config(ROWS, tok.eos_token_id, **overrides)
    tensors = random_sdar_tensors(cfg, seed=len(name), head_scale=12.0)  # sharp: confidences spread over (0, 1)
    src = write_hf_checkpoint(tmp_path_factory.mktemp("hf") / name, cfg, tensors, tok)
    from localleap_jax.convert_hf import convert

    out = tmp_path_factory.mktemp("conv") / name
    convert(str(src), str(out), progress=False)
    model = ll.load(out, dtype="float32")
    state = {k: v.numpy() for k, v in tensors.items()}
    torch_model = reference_sdar.sdar_torch_model(json.loads((out / "config.json").read_text()), state)
    return model, torch_model, out


@pytest.fixture(scope="module")
def sdar4(tmp_path_factory, sdar_tokenizer):
    """Untied head, block 4 (the released chat models' block), config.json without block_size or mask id."""
    return _build(tmp_path_factory, sdar_tokenizer, "sdar-b4")


@pytest.fixture(scope="module")
def sdar8(tmp_path_factory, sdar_tokenizer):
    """Tied head (no lm_head.weight in the checkpoint), block 8 stated in config.json."""
    return _build(tmp_path_factory, sdar_tokenizer, "sdar-b8", tie_word_embeddings=True, block_size=8)


def _batch(lengths, seed=0, n_ids=290):
    """Left-padded random prompts of the given lengths (ids below the special tokens)."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), bool)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.integers(3, n_ids, n)
        mask[i, width - n:] = True
    return ids, mask


def _reference(model, torch_model, prompt, **kw):
    """SDAR's loop on the torch model, never predicting what the JAX loop never predicts."""
    never = [model.special.mask, *range(model.special.vocab_limit, model.config.embedding_size)]
    logits_fn = reference_sdar.sdar_logits_fn(torch_model, model.config.block_size)
    return reference_sdar.block_diffusion_generate(logits_fn, prompt, mask_id=model.special.mask,
                                                   block_length=model.config.block_size, never_predict=never, **kw)


# ---------------------------------------------------------------- config and conversion


def test_conversion_reads_the_mask_id_from_the_tokenizer_and_states_the_block(sdar4, sdar8, sdar_tokenizer):
    model, _, out = sdar4
    c = model.config
    assert c.family == "sdar" and c.block_causal and c.qk_norm
    assert c.block_size == 4  # absent from the source config.json: SDAR's released default
    assert c.mask_token_id == sdar_tokenizer.convert_tokens_to_ids("<|MASK|>")
    assert c.head_dim == 24 and c.head_dim != c.d_model // c.n_heads
    assert c.pad_token_id == c.eos_token_id  # SDAR's config has no pad id
    written = json.loads((out / "config.json").read_text())
    assert written["block_size"] == 4 and written["mask_token_id"] == c.mask_token_id
    assert model.special.eot == sdar_tokenizer.convert_tokens_to_ids("<|im_end|>")
    tied = sdar8[0]
    assert tied.config.tie_word_embeddings and tied.config.block_size == 8 and "ff_out" not in tied.params


def test_sdar_configs_that_would_run_wrongly_are_refused_in_one_line():
    base = tiny_sdar_config(ROWS, 0, mask_token_id=3)
    assert read_config(base).family == "sdar"
    for bad, words in (({"attention_bias": True}, "attention_bias"), ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
                       ({"use_sliding_window": True}, "sliding"), ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"mask_token_id": None}, "python -m convert")):
        with pytest.raises(ConfigError, match=words):
            read_config({**base, **bad})


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("which", ["sdar4", "sdar8"])
def test_fp32_logits_match_transformers_qwen3_under_the_block_causal_mask(which, request):
    model, torch_model, _ = request.getfixturevalue(which)
    ids, mask = _batch([23, 17, 9], seed=1)
    ours = np.asarray(forward(model.params, ids, mask, model.config))
    ref = reference_sdar.block_causal_logits(torch_model, ids, mask, model.config.block_size)
    err = np.abs(ours - ref)[mask].max()
    print(f"{which} fp32 max |diff| = {err:.2e} (logit scale {np.abs(ref[mask]).max():.2f})")
    assert err <= FP32_TOL
    # The test can fail: the same network attending bidirectionally is far off.
    bidirectional = ModelConfig(**{**model.config.__dict__, "block_size": 0, "family": "dream", "qk_norm": True})
    wrong = np.asarray(forward(model.params, ids, mask, bidirectional))
    assert np.abs(wrong - ref)[mask].max() > 100 * FP32_TOL


def test_bf16_logits_stay_close_to_the_fp32_reference(sdar4):
    model, torch_model, out = sdar4
    bf16 = ll.load(out, dtype="bfloat16")
    ids, mask = _batch([23, 17], seed=2)
    ours = np.asarray(forward(bf16.params, ids, mask, bf16.config), np.float32)
    ref = reference_sdar.block_causal_logits(torch_model, ids, mask, 4)
    rel = np.abs(ours - ref)[mask].max() / np.abs(ref[mask]).max()
    print(f"bf16 max |diff| / logit scale = {rel:.3f}")
    assert rel < 0.05  # measured 0.009-0.012; bf16 has 8 bits of mantissa over 3 layers


# ---------------------------------------------------------------- decoding against SDAR's loop


def _ours(model, ids, mask, rule, gen_length, trace=False, **kw):
    cfg = ll.DecodeConfig(strategy=rule, gen_length=gen_length, block_length=model.config.block_size, **kw)
    return ll.generate(model, ids, mask, cfg, trace=trace)


@pytest.mark.parametrize("which,prompt_len,strategy,steps_per_block", [
    ("sdar4", 12, "low_confidence_dynamic", 2),   # prompt on the grid
    ("sdar4", 13, "low_confidence_dynamic", 4),   # the prompt's last block is decoded with the answer
    ("sdar4", 14, "low_confidence_static", 2),
    ("sdar8", 16, "low_confidence_static", 4),
    ("sdar8", 19, "low_confidence_dynamic", 4),
])
def test_tokens_equal_sdars_block_diffusion_generate(which, prompt_len, strategy, steps_per_block, request):
    model, torch_model, _ = request.getfixturevalue(which)
    T, G = model.config.block_size, 21  # gen_length off the grid: the last block ends past it
    ids, mask = _batch([prompt_len], seed=prompt_len)
    blocks = -(-(prompt_len + G) // T) - prompt_len // T
    threshold = 0.3  # where both of dynamic's branches fire on these weights
    name = "dynamic" if strategy.endswith("dynamic") else "low_confidence"
    rule = ll.rule(name, steps=blocks * steps_per_block, **({"threshold": threshold} if name == "dynamic" else {}))
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=rule, gen_length=G, block_length=T), trace=True)
    ref, counts = _reference(model, torch_model, ids[0], gen_length=G, denoising_steps=steps_per_block,
                             remasking_strategy=strategy, confidence_threshold=threshold)
    print(f"{which} P={prompt_len} {strategy}: our NFE {out.nfe[0]} (denoising passes; the store rides on the "
          f"next block's first pass) vs SDAR's {counts['nfe']} = {counts['prefill']} prefill + {counts['denoise']} "
          f"denoising + {counts['store']} store")
    np.testing.assert_array_equal(out.tokens[0, out.prompt_length:], ref[prompt_len:prompt_len + G])
    assert out.nfe[0] == counts["denoise"]
    assert counts["nfe"] == out.nfe[0] + counts["store"] + counts["prefill"]
    if name == "dynamic":  # both branches really happened
        used = set(np.unique(out.trace.clause[0][out.trace.clause[0] > 0]).tolist())
        assert {1, 2} <= used, used


def test_sdars_topk_overwrites_decoded_positions_where_ours_commits_only_masks(sdar4):
    """The one place the loop departs from SDAR's code on purpose (the `dynamic` rule's docstring)."""
    model, torch_model, _ = sdar4
    ids, mask = _batch([13], seed=13)  # 1 prompt token in the first decoded block: 3 masks, quota 2 then 2
    kw = dict(gen_length=11, denoising_steps=2, remasking_strategy="low_confidence_static")
    fixed, _ = _reference(model, torch_model, ids[0], **kw)
    buggy, _ = _reference(model, torch_model, ids[0], commit_only_masked=False, **kw)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("low_confidence", steps=8), gen_length=11,
                                                        block_length=4))
    np.testing.assert_array_equal(out.tokens[0, out.prompt_length:], fixed[13:24])
    assert not np.array_equal(buggy, fixed)


def test_localleap_inside_sdar_blocks_equals_its_eager_transcription(sdar8):
    model, torch_model, _ = sdar8
    ids, mask = _batch([11], seed=5)
    kappa, tau, radius = 0.5, 0.2, 2  # anchors and relaxed commits both occur on these weights
    out = _ours(model, ids, mask, ll.rule("localleap", kappa=kappa, tau=tau, radius=radius), 29, trace=True)
    ref, counts = _reference(model, torch_model, ids[0], gen_length=29, denoising_steps=8,
                             rule=reference_sdar.localleap_rule(kappa, tau, radius))
    np.testing.assert_array_equal(out.tokens[0, out.prompt_length:], ref[11:40])
    assert out.nfe[0] == counts["denoise"]
    names = out.trace.clause_names
    used = {names[c - 1] for c in np.unique(out.trace.clause[0][out.trace.clause[0] > 0])}
    assert {"anchor", "relaxed"} <= used, used
    print(f"localleap in blocks of 8: NFE {out.nfe[0]} vs SDAR's loop {counts['nfe']}")


def test_a_left_padded_batch_equals_each_row_alone_and_the_uncached_loop(sdar4):
    model, _, _ = sdar4
    lengths = [5, 8, 11, 14]  # four offsets in the block: rows decode different numbers of blocks
    ids, mask = _batch(lengths, seed=7)
    kappas = [0.5, 0.7, 0.6, 0.5]  # per-row settings, as for LLaDA
    batch = _ours(model, ids, mask, ll.rule("localleap", kappa=np.asarray(kappas), tau=0.2), 18)
    assert batch.full_passes > 0  # passes that also stored a finished block happened
    alone_nfe = []
    for i, n in enumerate(lengths):
        one = _ours(model, ids[i:i + 1, -n:], None, ll.rule("localleap", kappa=kappas[i], tau=0.2), 18)
        np.testing.assert_array_equal(one.tokens[0, one.prompt_length:], batch.tokens[i, batch.prompt_length:])
        alone_nfe.append(int(one.nfe[0]))
    assert alone_nfe == batch.nfe.tolist() and len(set(alone_nfe)) > 1
    # Without a cache (every pass recomputes the canvas, block-causally): the same tokens.
    uncached = _ours(model, ids, mask, ll.rule("localleap", kappa=np.asarray(kappas), tau=0.2), 18, cache="none")
    np.testing.assert_array_equal(uncached.tokens, batch.tokens)
    assert uncached.nfe.tolist() == batch.nfe.tolist()
    # rows decode up to their grid's end: ceil((n % 4 + 18) / 4) blocks, the tail past gen_length included
    assert batch.tokens.shape[1] == batch.prompt_length + 18
    assert grid_tail(18, 4) == 3


# ---------------------------------------------------------------- mistakes


def test_settings_a_block_diffusion_model_cannot_run_are_refused_before_compiling(sdar4, converted):
    model, _, _ = sdar4
    ids, mask = _batch([9])
    cases = [
        (dict(block_length=32), "attends in blocks of 4"),
        (dict(block_length=4, cache="prefix"), "block-diffusion model's are exact"),
        (dict(block_length=4, strategy=ll.rule("low_confidence", steps=3)), "every block needs a step"),
    ]
    for kw, words in cases:
        with pytest.raises(DecodeError, match=words):
            ll.generate(model, ids, mask, ll.DecodeConfig(**{"gen_length": 16, **kw}))
    llada = ll.load(converted, dtype="float32")
    with pytest.raises(DecodeError, match="needs a block-diffusion model"):
        ll.generate(llada, ids, mask, ll.DecodeConfig(gen_length=16, block_length=4, cache="block"))


def test_the_trace_records_every_generated_position_once(sdar4):
    model, _, _ = sdar4
    ids, mask = _batch([6, 13], seed=3)
    out = _ours(model, ids, mask, ll.rule("threshold", kappa=0.5), 15, trace=True)
    assert (out.trace.committed.sum(axis=1) == 1).all()  # every generated position committed in exactly one pass
    np.testing.assert_array_equal(out.trace.token, out.tokens[:, out.prompt_length:])
    assert not np.any(out.tokens[:, out.prompt_length:] == model.special.mask)
    assert jnp.all(out.trace.commit_pass >= 0)


# ---------------------------------------------------------------- the lm-eval adapter


def test_the_lm_eval_adapter_decodes_in_the_model_s_blocks(sdar4):
    from lm_eval.api.instance import Instance

    from localleap_jax.lm_eval import LocalLeapLM, ModelArgsError

    model, _, _ = sdar4
    lm = LocalLeapLM(model=model, compile_cache=False, progress=False, strategy="dynamic:threshold=0.3",
                     gen_length=15)
    assert lm.cfg.block_length == 4 and lm.cfg.cache_mode(model.config) == "block"  # the model's, not 32
    ctxs = ["Question: Tom has 9 pens.\nAnswer:", "Question: Mia has 3 apples and 4 more.\nAnswer:"]
    answers = lm.generate_until([Instance("generate_until", {}, (c, {"until": []}), i) for i, c in enumerate(ctxs)])
    for ctx, answer in zip(ctxs, answers):  # each as ll.generate gives it alone
        ids = np.asarray([model.tokenizer.encode(ctx)], np.int32)
        out = ll.generate(model, ids, None, lm.cfg)
        assert answer == model.tokenizer.decode_generated(out)[0]
    with pytest.raises(ModelArgsError, match="block_length must be 4"):
        LocalLeapLM(model=model, compile_cache=False, progress=False, block_length=8, gen_length=16)


def test_a_gen_length_off_the_block_is_taken_by_every_entry_point(sdar4, converted):
    """Issue #47: one behaviour for a gen_length that is not a multiple of the model's block, the one README and SDAR's
    own loop have (the grid's last block is decoded past it, not returned). ll.generate took it, and the adapter given
    gen_length alone; the adapter given both (as eval_gsm8k makes it, every DecodeConfig field) and sweep's points
    refused it (gen_length // block_length blocks for `steps`). All take it now; a bidirectional model's canvas is
    still cut into whole blocks."""
    from localleap_jax.commands import sweep
    from localleap_jax.gsm8k import EvalSettings
    from localleap_jax.lm_eval import LocalLeapLM, ModelArgsError

    model, _, _ = sdar4
    settings = EvalSettings.for_model({}, gen_length=15, num_fewshot=0, batch_size=2, model=model.config)
    cfg = settings.check("threshold")
    assert (cfg.gen_length, cfg.block_length) == (15, 4)
    lm = LocalLeapLM(model=model, compile_cache=False, progress=False,
                     **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})  # gsm8k/run.py's call
    assert (lm.cfg.gen_length, lm.cfg.block_length) == (15, 4)
    assert sweep.check_point("low_confidence", {"steps": 5}, settings) == ("low_confidence:steps=5", None)
    llada = ll.load(converted, dtype="float32")
    bidirectional = dataclasses.replace(settings, model=llada.config)
    with pytest.raises(DecodeError, match=r"^gen_length=15 is not a multiple of block_length=4$"):
        bidirectional.check("threshold")
    with pytest.raises(ModelArgsError, match=r"gen_length=15 is not a multiple of block_length=4"):
        LocalLeapLM(model=llada, compile_cache=False, progress=False, gen_length=15, block_length=4)


def test_sampling_takes_the_same_gumbel_max_path_as_the_other_families(sdar4):
    import jax

    model, _, _ = sdar4
    ids, mask = _batch([7, 10], seed=11)
    cfg = ll.DecodeConfig(strategy="dynamic", gen_length=12, block_length=4, temperature=1.0)
    a, c = (ll.generate(model, ids, mask, cfg, jax.random.key(k)) for k in (0, 1))
    greedy = ll.generate(model, ids, mask, dataclasses.replace(cfg, temperature=0.0))
    assert not np.array_equal(a.tokens, c.tokens) and not np.array_equal(a.tokens, greedy.tokens)
    assert not np.any(a.tokens[:, a.prompt_length:] == model.special.mask)
