"""Dream (Qwen2.5 block, q/k/v biases, shifted logits) against transformers' Qwen2 on the same weights.

The reference is `Qwen2ForCausalLM` holding Dream's tensors, called bidirectionally (all-ones 4D
mask); Dream's one-position shift `cat([l[:, :1], l[:, :-1]], 1)` is applied to its output here,
as Dream's own generation code does.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import localleap_jax as ll
from oracles import bidirectional as reference_torch
from localleap_jax.config import ConfigError, ModelConfig
from localleap_jax.model import forward, head, positions_from_mask, trunk
from localleap_jax.tokenizer import left_pad
from localleap_jax.families import read_config, write_config

import near_misses
from helpers import decode_config

# fp32 against transformers' Qwen2 (logit scale ~2.2): measured max |diff| 5.7e-6 to 8.0e-6 over seeds 0-4 of
# [2, 37] ids, 4.1e-6 to 6.4e-6 with a key mask, 4.5e-6 to 7.2e-6 unshifted; transformers' own fp32 differs from
# its float64 run by as much (5.7e-6 to 7.3e-6). Near misses measured the same way: RoPE theta 1e4 (the default)
# 2.0, interleaved RoPE 2.4, one of the q/k/v biases dropped 1.1 to 1.8. The eps placement in RMSNorm is below
# this noise at Dream's eps 1e-6 (1.1e-5): test_model.py's RMSNorm unit tests decide it.
FP32_TOL = 2e-5


@pytest.fixture(scope="module")
def dream32(dream_converted):
    return ll.load(dream_converted, dtype="float32")


def _reference(hf_checkpoint, ids, mask=None, shift=True):
    _, cfg, tensors = hf_checkpoint
    ref = reference_torch.qwen2_from_dream(cfg, tensors)
    logits = reference_torch.bidirectional_logits(ref, torch.tensor(ids), None if mask is None else torch.tensor(mask))
    logits = logits.numpy()
    return np.concatenate([logits[:, :1], logits[:, :-1]], axis=1) if shift else logits


def _ids(n_ids, shape, seed=0):
    return np.random.RandomState(seed).randint(0, n_ids, shape).astype(np.int32)


def test_fp32_logits_match_transformers_qwen2_shifted(dream_hf_checkpoint, dream32):
    model = dream32
    assert model.config.family == "dream" and model.config.logits_shift == 1 and model.config.qkv_bias
    assert (model.config.n_heads, model.config.n_kv_heads) == (14, 2)  # 7 query heads per KV head
    ids = _ids(300, (2, 37))
    ours = np.asarray(forward(model.params, ids, None, model.config))
    ref = _reference(dream_hf_checkpoint, ids)
    err = np.abs(ours - ref).max()
    print(f"dream fp32 max |diff| = {err:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert err <= FP32_TOL
    assert ours.shape == (2, 37, 320)
    # the shift really happened: unshifted logits are far from the reference's shifted ones
    assert np.abs(ours[:, 1:] - _reference(dream_hf_checkpoint, ids, shift=False)[:, 1:]).max() > 100 * FP32_TOL


def test_trunk_and_head_stay_unshifted(dream_hf_checkpoint, dream32):
    model = dream32
    ids = _ids(300, (2, 19), seed=1)
    mask = np.ones_like(ids, bool)
    h, _ = trunk(model.params, ids, positions_from_mask(mask), mask, model.config)
    ours = np.asarray(head(model.params, h, model.config))
    assert np.abs(ours - _reference(dream_hf_checkpoint, ids, shift=False)).max() <= FP32_TOL


def test_qkv_biases_are_converted_and_matter(dream_hf_checkpoint, dream32):
    _, cfg, tensors = dream_hf_checkpoint
    model = dream32
    for ours, hf in (("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"), ("v_proj", "self_attn.v_proj")):
        layers = model.params["layers"]
        assert len(layers) == cfg["num_hidden_layers"]
        bias = np.asarray(layers[2][ours]["bias"])
        assert bias.shape == tensors[f"model.layers.0.{hf}.bias"].shape
        np.testing.assert_array_equal(bias, tensors[f"model.layers.2.{hf}.bias"].numpy())
    # Each bias on its own is far from a rounding-level detail: dropping any one of them (the k bias only matters
    # through RoPE, which rotates it with the position) fails the parity test by orders of magnitude.
    ids = _ids(300, (2, 37))
    ref = _reference(dream_hf_checkpoint, ids)
    for proj in ("q_proj", "k_proj", "v_proj"):
        layers = tuple({**layer, proj: {**layer[proj], "bias": jnp.zeros_like(layer[proj]["bias"])}}
                       for layer in model.params["layers"])
        err = np.abs(np.asarray(forward({**model.params, "layers": layers}, ids, None, model.config)) - ref).max()
        print(f"without the {proj} bias: max |diff| = {err:.2e}")
        assert err > 0.4  # measured 1.1 (k) to 1.8 (q) over seeds 0-4


@pytest.mark.parametrize("name", ["theta 1e4", "interleaved rope"])
def test_the_fp32_tolerance_sees_near_miss_rope(dream_hf_checkpoint, dream32, monkeypatch, name):
    from localleap_jax import model as model_module

    rope = model_module.rope
    variant = {"theta 1e4": lambda x, p, theta, rotary_dim=None: rope(x, p, 1e4, rotary_dim), "interleaved rope": near_misses.rope_interleaved}[name]
    model = dream32
    ids = _ids(300, (2, 37))
    monkeypatch.setattr(model_module, "rope", variant)
    with jax.disable_jit():  # op by op, so the patched function is what runs (not a program compiled before)
        ours = np.asarray(forward(model.params, ids, None, model.config))
    err = np.abs(ours - _reference(dream_hf_checkpoint, ids)).max()
    print(f"{name}: max |diff| = {err:.2e}")
    assert err > 3 * FP32_TOL


def test_bf16_source_converts_and_stays_close(tmp_path, dream_hf_checkpoint, dream_tokenizer):
    from helpers import write_dream_checkpoint
    from localleap_jax.convert_hf import convert

    src, cfg, tensors = dream_hf_checkpoint
    bf16 = write_dream_checkpoint(tmp_path / "bf16", cfg, tensors, dream_tokenizer, n_shards=3, dtype=torch.bfloat16)
    convert(str(bf16), str(tmp_path / "out"), progress=False)
    model = ll.load(tmp_path / "out")  # bf16
    assert model.dtype == jnp.bfloat16
    ids = _ids(300, (4, 33), seed=3)
    ours = np.asarray(forward(model.params, ids, None, model.config))
    ref = _reference(dream_hf_checkpoint, ids)
    agree = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"dream bf16: max relative diff {rel:.3f}, argmax agreement {agree:.3f}")
    # Measured over seeds 3-7 of [4, 33] ids: relative diff 0.054-0.073, agreement 0.917-0.947; transformers' own
    # bf16 Qwen2 on the same ids: 0.053-0.060 and 0.879-0.947. The margins are ~2x of the worst (disagreement 8.3%).
    assert ours.dtype == np.float32 and rel < 0.15 and agree > 0.85


def test_left_padded_rows_equal_unpadded_rows(dream32):
    model = dream32
    lengths = [9, 4, 13]
    rng = np.random.RandomState(4)
    rows = [rng.randint(0, 300, n) for n in lengths]
    width = max(lengths)
    ids = np.full((3, width), model.config.pad_token_id, np.int32)
    mask = np.zeros((3, width), bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, True
    batch = np.asarray(forward(model.params, ids, mask, model.config))
    for i, r in enumerate(rows):
        alone = np.asarray(forward(model.params, r[None].astype(np.int32), None, model.config))[0]
        # every real position, the first one included (it keeps its own logits, padded or not);
        # measured 2.4e-6 to 3.5e-6 (seeds 4-7)
        np.testing.assert_allclose(batch[i, width - len(r):], alone, atol=1e-5, rtol=0)


def test_padding_matches_reference_with_key_mask(dream_hf_checkpoint, dream32):
    model = dream32
    ids = _ids(300, (2, 20), seed=5)
    mask = np.ones_like(ids, bool)
    mask[0, :7] = False
    ours = np.asarray(forward(model.params, ids, mask, model.config))
    ref = _reference(dream_hf_checkpoint, ids, mask)
    # Positions whose predecessor is a real token: there the whole-row shift and ours agree (at a row's
    # first real token the whole-row shift reads a padding position's output).
    scored = mask & np.concatenate([np.zeros((2, 1), bool), mask[:, :-1]], axis=1)
    assert np.abs(ours - ref)[scored].max() <= FP32_TOL


def test_tokenizer_is_chatml_with_ids_from_the_checkpoint(dream_hf_checkpoint, dream32, dream_converted, dream_tokenizer):
    _, cfg, _ = dream_hf_checkpoint
    model = dream32
    tok = model.tokenizer
    assert tok.chat("What is 2 + 3?") == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                                          "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eot_id == dream_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (tok.mask_id, tok.eos_id, tok.pad_id) == (cfg["mask_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    assert tok.vocab_size == len(dream_tokenizer) == 300 < model.config.embedding_size == 320
    assert tok.stop_ids == (cfg["eos_token_id"], tok.eot_id)
    # the converted tokenizer encodes as the source's did (built from vocab.json + merges.txt, no remote code)
    text = "Question: Mia has 3 apples. 9 - 2 = 7"
    assert tok.encode(text, chat=False) == dream_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert not (dream_converted / "tokenization_dream.py").exists()
    assert "auto_map" not in json.loads((dream_converted / "tokenizer_config.json").read_text())
    words = tok.hf("7 apples", add_special_tokens=False)["input_ids"]
    assert tok.decode_generated(np.array([words + [tok.eot_id, *words]]), prompt_length=0) == ["7 apples"]


def test_dream_7b_config_reads_as_the_qwen2_block():
    """Dream-v0-Instruct-7B's config.json values (see the closing note for where each was read)."""
    cfg = {"architectures": ["DreamModel"], "model_type": "Dream", "hidden_size": 3584, "intermediate_size": 18944,
           "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None,
           "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
           "hidden_act": "silu", "mask_token_id": 151666, "pad_token_id": 151643, "eos_token_id": 151643,
           "bos_token_id": 151643, "use_mrope": False, "torch_dtype": "bfloat16"}
    c = read_config(cfg)
    assert (c.family, c.qkv_bias, c.logits_shift, c.head_dim) == ("dream", True, 1, 128)
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.n_layers, c.mlp_hidden_size) == (3584, 28, 4, 28, 18944)
    assert (c.embedding_size, c.rms_norm_eps, c.rope_theta) == (152064, 1e-6, 1e6)
    assert (c.mask_token_id, c.eos_token_id, c.pad_token_id) == (151666, 151643, 151643)
    assert 7.6e9 < c.num_params < 7.7e9  # the hub page says 7.62B
    assert read_config(write_config(c)) == c


@pytest.mark.parametrize("change, named", [
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"use_mrope": True}, "use_mrope"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "model_type='qwen2'"),
    ({"architectures": ["LLaDAModelLM"]}, "contradicts itself"),
])
def test_unimplemented_dream_configs_are_refused_by_name(dream_hf_checkpoint, change, named):
    with pytest.raises(ConfigError, match=named):
        read_config({**dream_hf_checkpoint[1], **change})


def test_a_dream_checkpoint_cannot_be_loaded_as_llada(tmp_path, dream_converted, hf_checkpoint):
    """Same tree shapes but LLaDA's config.json: the q/k/v biases have nowhere to go."""
    d = tmp_path / "ck"
    shutil.copytree(dream_converted, d)
    c = ll.load(dream_converted, dtype="float32").config
    llada = write_config(ModelConfig(**{**c.__dict__, "family": "llada", "qkv_bias": False}))
    (d / "config.json").write_text(json.dumps(llada))
    with pytest.raises(ll.CheckpointError, match=r"unexpected \['blocks'\]\['k_proj'\]\['bias'\]"):
        ll.load(d)


# ---------------------------------------------------------------- decoding: the shifted family against the eager loop
# (moved from test_decode_vs_torch.py: these are Dream's)

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 3, 250, 11, 64, 8, 31, 200], [77, 12, 150]]  # as test_decode_vs_torch's


def _dream(tmp_path_factory, tok, n_layers, seed):
    """A converted random Dream-layout model whose confidences spread, and its Qwen2 torch twin."""
    from helpers import random_dream_tensors, tiny_dream_config, write_dream_checkpoint
    from localleap_jax.convert_hf import convert

    cfg = tiny_dream_config(320, tok.mask_token_id, tok.eos_token_id, num_hidden_layers=n_layers)
    tensors = random_dream_tensors(cfg, seed=seed, head_scale=20.0)
    d = tmp_path_factory.mktemp(f"dream{n_layers}")
    convert(str(write_dream_checkpoint(d / "hf", cfg, tensors, tok)), str(d / "ck"), progress=False)
    return ll.load(d / "ck", dtype="float32"), reference_torch.qwen2_from_dream(cfg, tensors)


@pytest.fixture(scope="module")
def sharp_dream(tmp_path_factory, dream_tokenizer):
    return _dream(tmp_path_factory, dream_tokenizer, n_layers=2, seed=21)


@pytest.fixture(scope="module")
def one_layer_dream(tmp_path_factory, dream_tokenizer):
    return _dream(tmp_path_factory, dream_tokenizer, n_layers=1, seed=22)


@pytest.mark.parametrize("strategy", ["threshold", "localleap", "low_confidence"])
def test_dream_decodes_as_the_eager_loop_with_the_shift(sharp_dream, strategy):
    """Dream predicts position i from the hidden state at i - 1: a left-padded batch equals the eager
    loop (transformers' Qwen2, logits shifted before anything else) row by row, tokens and NFE."""
    model, torch_model = sharp_dream
    assert model.config.logits_shift == 1 and model.tokenizer.vocab_size < model.config.embedding_size
    setting = dict(gen_length=24, block_length=8, **({"kappa": 0.8, "tau": 0.5} if strategy != "low_confidence" else {}))
    ids, mask = left_pad(PROMPTS, model.config.pad_token_id)
    out = ll.generate(model, ids, mask, decode_config(strategy, **setting))
    unshifted = []
    for r, prompt in enumerate(PROMPTS):
        kw = dict(strategy=strategy, mask_id=model.config.mask_token_id, eos_id=model.config.eos_token_id,
                  eot_id=model.tokenizer.eot_id, vocab_limit=model.tokenizer.vocab_size, **setting)
        x, nfe = reference_torch.eager_generate(torch_model, torch.tensor([prompt]), shift=1, **kw)
        np.testing.assert_array_equal(out.tokens[r, out.prompt_length:], x[0, len(prompt):].numpy(), err_msg=f"row {r}")
        assert out.nfe[r] == nfe[0]
        x0, _ = reference_torch.eager_generate(torch_model, torch.tensor([prompt]), shift=0, **kw)
        unshifted.append((x0[0, len(prompt):].numpy() != x[0, len(prompt):].numpy()).any())
    assert any(unshifted)  # the shift changes what is decoded: a loop that ignored it would fail above


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("strategy", ["threshold", "localleap"])
def test_dream_caches_are_exact_where_they_cannot_go_stale(one_layer_dream, cache, strategy):
    """One layer: K/V depend only on each position's token, so prefix and dual caches must equal no cache.
    With the shift, a block's first token is predicted from the position before the block: the cached
    pass must recompute that position's hidden state (from this pass's block), not reuse the refresh's."""
    model, torch_model = one_layer_dream
    ids, mask = left_pad(PROMPTS, model.config.pad_token_id)
    base = dict(strategy=strategy, gen_length=32, block_length=8, kappa=0.8, tau=0.5, radius=2)
    want = ll.generate(model, ids, mask, decode_config(**base))
    got = ll.generate(model, ids, mask, decode_config(**base, cache=cache))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.nfe, want.nfe)
    # one refresh per block and row (rows that start a block together share the pass); more than one pass per block
    assert 4 <= got.full_passes <= 4 * len(PROMPTS) and want.forward_passes > got.full_passes
    for r, prompt in enumerate(PROMPTS):  # and no cache is the eager loop
        x, nfe = reference_torch.eager_generate(
            torch_model, torch.tensor([prompt]), shift=1, mask_id=model.config.mask_token_id,
            eos_id=model.config.eos_token_id, eot_id=model.tokenizer.eot_id, vocab_limit=model.tokenizer.vocab_size,
            **base)
        np.testing.assert_array_equal(want.tokens[r, want.prompt_length:], x[0, len(prompt):].numpy())


# ---------------------------------------------------------------- LLaDA's switches on a model that emits EOS and EOT
