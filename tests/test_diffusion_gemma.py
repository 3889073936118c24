"""DiffusionGemma (families/diffusion_gemma.py) against the installed transformers (`models/diffusion_gemma`):
config.json in both forms, the encoder's K/V and logits, the decoder's logits (with and without
self-conditioning, after several encoded canvases), left padding, the sampler's deterministic pieces
(temperature, entropy-bound acceptance, the stopping criterion, the self-conditioning input), the compiled decode
loop with a canvas rule against transformers' generate (its draws supplied), what a canvas rule refuses, and
conversion.

The reference is a tiny random `DiffusionGemmaForBlockDiffusion` (eager attention) whose every weight, norm,
router scale and layer scalar is drawn away from its init value (norms around 1, the encoder's layer scalars
different from the decoder's), so a norm read as 1 + w, a scalar taken from the wrong stack or a skipped scale
shows. Layers: sliding, full, sliding, sliding, full with a sliding window of 5 under prompts of up to 12 tokens,
every layer a MoE layer, global layers with their own head size and one K/V head.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError, DecodeError
from localleap_jax.families import diffusion_gemma as dg
from localleap_jax.families import read_config, write_config
from localleap_jax.families.target import leaf_of, parts, swap_last

from helpers import TOKENIZER_CORPUS

VOCAB = 300  # the tiny tokenizer's byte-level BPE knows up to 300 ids
W = 5  # sliding window: shorter than every prompt below
C = 8  # canvas length
IMAGE_ID = 290
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=W,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                         "full_attention"],
            num_experts=6, top_k_experts=2, moe_intermediate_size=16, max_position_embeddings=512,
            eos_token_id=0, pad_token_id=0, bos_token_id=1)
VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=16)
# fp32 against transformers (eager attention), measured max |diff|: encoder logits 1.7e-5 (scale 2.3), the last
# layer's keys 1.5e-5, decoder logits 4.6e-6 (scale 2.4), after two encoded canvases 8.1e-6 (scale 3.5); the
# self-conditioning input 1.2e-7. Our own paths against each other (a left-padded row and the row alone, chunked
# and one-pass encoding) differ by up to 7e-6. Tolerances: 1.5x and 2x those.
FP32_TOL = 2.5e-5
SELF_TOL = 1.5e-5


def hf_config(**text):
    from transformers import DiffusionGemmaConfig

    config = DiffusionGemmaConfig(text_config={**TEXT, **text}, vision_config=VISION, canvas_length=C,
                                  image_token_id=IMAGE_ID)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    return config


def randomized(model, seed: int):
    """Every parameter and layer scalar away from its init: vectors (norms, scales) around 1, matrices N(0, 0.1),
    the encoder's layer scalars drawn apart from the decoder's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if p.ndim == 1 else 0.1 * noise)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model.eval()


def params_from_state(state: dict, config: ModelConfig) -> dict:
    """Our tree from transformers' state dict, through the family's tensor map (what the converter does)."""
    from localleap_jax.checkpoint.reading import abstract_params

    params = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), abstract_params(config, jnp.float32))
    for name, entry in dg.tensor_map(config).items():
        src = state[name].detach().numpy()
        for t in parts(entry):
            block = src if t.rows is None else src[..., t.rows[0]:t.rows[1], :]
            np.copyto(leaf_of(params, t), swap_last(block) if t.transpose else block)
    return params


@pytest.fixture(scope="module")
def pair():
    """(transformers model, our config, our params) on the same random weights."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    hf = randomized(DiffusionGemmaForBlockDiffusion(hf_config()), seed=1)
    config = read_config(hf.config.to_dict())
    return hf, config, params_from_state(hf.state_dict(), config)


def batch(seed: int, lengths: list[int], width: int):
    """Left-padded random ids [B, width] (no image ids) and their mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, IMAGE_ID - 10, (len(lengths), width)).astype(np.int64)
    mask = np.zeros(ids.shape, bool)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = True
    return ids, mask


def hf_positions(mask: np.ndarray) -> torch.Tensor:
    """Positions from each row's first real token (padding negative), as our encoder numbers them."""
    pads = (~mask).sum(1)
    return torch.from_numpy(np.arange(mask.shape[1])[None, :] - pads[:, None])


# ---------------------------------------------------------------- config.json


def released_form() -> dict:
    """config.json as released: global_head_dim / num_global_key_value_heads in text_config, no per_layer_config."""
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
            "canvas_length": C, "image_token_id": IMAGE_ID, "tie_word_embeddings": True,
            "text_config": {"model_type": "diffusion_gemma_text", **TEXT}, "vision_config": VISION}


def test_both_config_forms_read_alike_and_as_transformers_reads_them():
    from transformers import DiffusionGemmaConfig

    released = released_form()
    saved = hf_config().to_dict()  # save_pretrained's form
    assert "per_layer_config" in saved["text_config"] and "global_head_dim" not in saved["text_config"]
    assert "per_layer_config" not in released["text_config"]
    a, b = read_config(released), read_config(saved)
    assert a == b and a.family == "diffusion_gemma"
    arch = a.arch
    assert arch.layer_types == ("sliding", "full", "sliding", "sliding", "full")
    assert (arch.global_head_dim, arch.global_kv_heads, a.head_dim, a.n_kv_heads) == (16, 1, 8, 2)
    assert a.canvas_length == C and arch.sliding_window == W and arch.logit_softcap == 30.0
    assert arch.global_rotary == dg.Rotary("proportional", 1e6, 0.25) and arch.sliding_rotary.theta == 1e4
    # transformers reads the released form into the same per-layer sizes
    hf = DiffusionGemmaConfig(**{k: v for k, v in released.items() if k not in ("architectures", "model_type")})
    assert hf.text_config.per_layer_config[1].head_dim == arch.global_head_dim
    assert hf.text_config.per_layer_config[1].num_key_value_heads == arch.global_kv_heads
    # what this package writes reads back the same, in transformers too
    written = write_config(a)
    assert read_config(written) == a
    again = DiffusionGemmaConfig(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert again.text_config.per_layer_config[4].head_dim == 16 and again.canvas_length == C
    # no layer_types: transformers' pattern (five sliding, one full; the last layer forced full); a softcap given
    text = {k: v for k, v in TEXT.items() if k != "layer_types"} | {"num_hidden_layers": 7,
                                                                      "final_logit_softcapping": 12.0}
    default = read_config({**released, "text_config": text})
    hf_default = DiffusionGemmaConfig(text_config=text, vision_config=VISION).text_config
    assert default.arch.layer_types == tuple(dg.KINDS[t] for t in hf_default.layer_types)
    assert default.arch.layer_types[-2:] == ("full", "full")
    assert default.arch.logit_softcap == hf_default.final_logit_softcapping == 12.0


@pytest.mark.parametrize("change, words", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"num_experts": None}, "MoE"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "yarn"),
    ({"per_layer_config": {"0": {"head_dim": 16}}}, "sliding layer 0"),
])
def test_refuses_what_it_does_not_implement_in_one_line(change, words):
    cfg = released_form()
    cfg["text_config"] = {**cfg["text_config"], **change}
    with pytest.raises(ConfigError) as e:
        read_config(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the network against transformers


def test_encoder_kv_and_logits_match_transformers(pair):
    hf, config, params = pair
    ids, mask = batch(0, [12, 9, 10], 12)
    logits, kv = dg.encode(params, ids, mask, config)
    with torch.no_grad():
        out = hf.model.encoder(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               position_ids=hf_positions(mask))
        ref_logits = torch.tanh(hf.lm_head(out.last_hidden_state) / 30.0) * 30.0
    assert len(kv) == config.n_layers
    kept = []
    for layer, (k, v) in enumerate(kv):
        hk = out.cache.layers[layer].keys.numpy().transpose(0, 2, 1, 3)  # [B, slots, K, hd]
        hv = out.cache.layers[layer].values.numpy().transpose(0, 2, 1, 3)
        n = hk.shape[1]  # the sliding layers keep W - 1 slots, the full ones all
        kept.append(n)
        real = mask[:, -n:]
        np.testing.assert_allclose(np.asarray(k)[:, -n:][real], hk[real], atol=FP32_TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(v)[:, -n:][real], hv[real], atol=FP32_TOL, rtol=0)
    assert kept == [W - 1, 12, W - 1, W - 1, 12]  # the window was shorter than the prompt
    np.testing.assert_allclose(np.asarray(logits)[mask], ref_logits.numpy()[mask], atol=FP32_TOL, rtol=0)


def hf_decoder_logits(hf, ids, mask, canvas, sc_logits=None):
    """transformers' forward: encoder over ids, decoder over canvas reading its cache (positions continuing each
    row's count of real tokens)."""
    n = mask.sum(1)
    dec_pos = torch.from_numpy(n[:, None] + np.arange(canvas.shape[1])[None, :])
    dmask = torch.from_numpy(np.concatenate([mask, np.ones(canvas.shape, bool)], axis=1))
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                 position_ids=hf_positions(mask), decoder_input_ids=torch.from_numpy(canvas),
                 decoder_attention_mask=dmask, decoder_position_ids=dec_pos,
                 self_conditioning_logits=None if sc_logits is None else torch.from_numpy(sc_logits))
    return out.logits.float().numpy()


def test_decoder_logits_match_transformers_with_and_without_self_conditioning(pair):
    hf, config, params = pair
    ids, mask = batch(1, [11, 7], 11)
    canvas = np.random.default_rng(2).integers(0, VOCAB, (2, C))
    sc = np.random.default_rng(3).normal(0, 3, (2, C, VOCAB)).astype(np.float32)
    plain = dg.decoder_logits(params, ids, mask, canvas, config)
    conditioned = dg.decoder_logits(params, ids, mask, canvas, config, sc_logits=sc)
    ref_plain, ref_conditioned = hf_decoder_logits(hf, ids, mask, canvas), hf_decoder_logits(hf, ids, mask, canvas, sc)
    assert plain.shape == (2, C, VOCAB)
    np.testing.assert_allclose(np.asarray(plain), ref_plain, atol=FP32_TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(conditioned), ref_conditioned, atol=FP32_TOL, rtol=0)
    assert np.abs(ref_conditioned - ref_plain).max() > 0.1  # self-conditioning took part


def test_decoder_after_encoded_canvases_matches_transformers_cache(pair):
    """The generation's path: prompt, then two finished canvases encoded chunk by chunk into the static buffer,
    then the decoder; transformers' DynamicCache by the same calls (its sliding layers keep W - 1 slots)."""
    hf, config, params = pair
    ids, mask = batch(4, [6, 4], 6)
    rng = np.random.default_rng(5)
    chunks = [rng.integers(3, IMAGE_ID - 10, (2, C)) for _ in range(2)]
    canvas = rng.integers(0, VOCAB, (2, C))
    sc = rng.normal(0, 3, (2, C, VOCAB)).astype(np.float32)

    cache = dg.init_cache(config, 2, 6 + 2 * C)
    _, cache = dg.encode_into(params, cache, jnp.asarray(ids), jnp.asarray(mask), config)
    for chunk in chunks:
        _, cache = dg.encode_into(params, cache, jnp.asarray(chunk), jnp.ones(chunk.shape, bool), config)
    ours = dg.decode(params, cache, jnp.asarray(canvas), config, dg.soft_embedding(params, jnp.asarray(sc), config))

    full_mask, positions = mask, hf_positions(mask)
    with torch.no_grad():
        out = hf.model.encoder(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               position_ids=positions)
        cache_hf = out.cache
        for chunk in chunks:
            full_mask = np.concatenate([full_mask, np.ones(chunk.shape, bool)], axis=1)
            positions = positions[:, -1:] + 1 + torch.arange(C)[None, :]
            cache_hf = hf.model.encoder(input_ids=torch.from_numpy(chunk), attention_mask=torch.from_numpy(full_mask),
                                        position_ids=positions, cache=cache_hf).cache
        dmask = torch.from_numpy(np.concatenate([full_mask, np.ones(canvas.shape, bool)], axis=1))
        ref = hf(cache=cache_hf, decoder_input_ids=torch.from_numpy(canvas), decoder_attention_mask=dmask,
                 decoder_position_ids=positions[:, -1:] + 1 + torch.arange(C)[None, :],
                 self_conditioning_logits=torch.from_numpy(sc)).logits.numpy()
    assert cache_hf.layers[0].keys.shape[2] == W - 1 < 6 + 2 * C
    np.testing.assert_allclose(np.asarray(ours), ref, atol=FP32_TOL, rtol=0)
    # The same K/V as one pass of the encoder over prompt and canvases.
    whole_ids = np.concatenate([ids, *chunks], axis=1)
    _, kv = dg.encode(params, whole_ids, np.concatenate([mask, np.ones((2, 2 * C), bool)], axis=1), config)
    for (k, v), (kc, vc) in zip(kv, dg.layer_kv(cache, config)):
        np.testing.assert_allclose(np.asarray(kc), np.asarray(k), atol=SELF_TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(vc), np.asarray(v), atol=SELF_TOL, rtol=0)


def test_left_padded_rows_equal_themselves_alone(pair):
    _, config, params = pair
    ids, mask = batch(6, [10, 3], 10)  # the second row: 7 pads, and fewer real tokens than the window
    canvas = np.random.default_rng(7).integers(0, VOCAB, (2, C))
    sc = np.random.default_rng(8).normal(0, 3, (2, C, VOCAB)).astype(np.float32)
    logits, kv = dg.encode(params, ids, mask, config)
    dec = dg.decoder_logits(params, ids, mask, canvas, config, sc_logits=sc)
    for b in range(2):
        alone = ids[b:b + 1, mask[b]]
        one_logits, one_kv = dg.encode(params, alone, np.ones(alone.shape, bool), config)
        np.testing.assert_allclose(np.asarray(logits)[b, mask[b]], np.asarray(one_logits)[0], atol=SELF_TOL, rtol=0)
        for (k, v), (k1, v1) in zip(kv, one_kv):
            np.testing.assert_allclose(np.asarray(k)[b, mask[b]], np.asarray(k1)[0], atol=SELF_TOL, rtol=0)
            np.testing.assert_allclose(np.asarray(v)[b, mask[b]], np.asarray(v1)[0], atol=SELF_TOL, rtol=0)
        one_dec = dg.decoder_logits(params, alone, np.ones(alone.shape, bool), canvas[b:b + 1], config,
                                    sc_logits=sc[b:b + 1])
        np.testing.assert_allclose(np.asarray(dec)[b], np.asarray(one_dec)[0], atol=SELF_TOL, rtol=0)


def test_bfloat16_parameters_err_as_much_as_transformers_in_bfloat16(pair):
    """bf16 parameters: our logits are as far from the fp32 reference as transformers' own bf16 model's (on these
    random weights bf16 moves both by ~30% of the logit scale: rounding flips some expert choices)."""
    import copy

    hf, config, params = pair
    ids, mask = batch(9, [8, 5], 8)
    canvas = np.random.default_rng(10).integers(0, VOCAB, (2, C))
    half = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    low = np.asarray(dg.decoder_logits(half, ids, mask, canvas, config))
    reference = hf_decoder_logits(hf, ids, mask, canvas)
    hf_low = hf_decoder_logits(copy.deepcopy(hf).to(torch.bfloat16), ids, mask, canvas)
    assert low.dtype == np.float32 and np.isfinite(low).all() and np.abs(low - reference).max() > 1e-3
    assert np.abs(low - reference).max() <= 1.5 * np.abs(hf_low - reference).max() + 0.05


def test_image_tokens_are_refused_in_one_line(pair):
    _, config, params = pair
    ids, mask = batch(11, [5], 5)
    ids[0, 2] = IMAGE_ID
    with pytest.raises(DecodeError) as e:
        dg.encode(params, ids, mask, config)
    assert "image" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DecodeError, match="image tokens"):  # in the prompt of decoder_logits too
        dg.decoder_logits(params, ids, mask, np.zeros((1, C), np.int64), config)


def test_a_canvas_holding_image_ids_is_noise_decoded_as_transformers_decodes_it(pair):
    """transformers' initial canvas draws uniformly over the whole vocabulary, image ids included: a canvas is noise,
    not a prompt, so decoder_logits takes one holding them (issue #47: refused before) and scores it as transformers
    does. Ids outside the vocabulary are refused in one line."""
    hf, config, params = pair
    ids, mask = batch(1, [11, 7], 11)  # the shapes of the decoder test above: its compiled program
    canvas = np.random.default_rng(2).integers(0, VOCAB, (2, C))
    canvas[0, 3] = canvas[1, 0] = IMAGE_ID
    ours = dg.decoder_logits(params, ids, mask, canvas, config)
    np.testing.assert_allclose(np.asarray(ours), hf_decoder_logits(hf, ids, mask, canvas), atol=FP32_TOL, rtol=0)
    canvas[1, 1] = VOCAB
    with pytest.raises(DecodeError, match=rf"^the canvas holds ids outside \[0, {VOCAB}\)"):
        dg.decoder_logits(params, ids, mask, canvas, config)


# ---------------------------------------------------------------- the sampler's deterministic pieces


def test_soft_embedding_is_transformers_self_conditioning_input(pair):
    hf, config, params = pair
    ids, mask = batch(12, [7], 7)
    canvas = np.random.default_rng(13).integers(0, VOCAB, (1, C))
    sc = np.random.default_rng(14).normal(0, 3, (1, C, VOCAB)).astype(np.float32)
    seen = {}

    def capture(module, args, kwargs):
        seen["signal"] = args[1].detach().numpy()

    handle = hf.model.decoder.self_conditioning.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        hf_decoder_logits(hf, ids, mask, canvas, sc)
    finally:
        handle.remove()
    ours = np.asarray(dg.soft_embedding(params, jnp.asarray(sc), config))
    np.testing.assert_allclose(ours, seen["signal"], atol=1e-5, rtol=1e-6)
    assert np.abs(seen["signal"]).max() > 1.0  # the sqrt(D) scale is in it


def test_temperature_schedule_is_transformers_processor_at_every_step():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import LinearTemperatureScheduleLogitsProcessor

    logits = np.random.default_rng(15).normal(0, 5, (2, 4, 16)).astype(np.float32)
    for n, t_min, t_max in ((48, 0.4, 0.8), (7, 0.1, 1.3)):
        processor = LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=n)
        temps = []
        for i in range(n):  # transformers counts cur_step down from N to 1
            ref = processor(None, torch.from_numpy(logits), cur_step=torch.tensor(n - i, dtype=torch.int32)).numpy()
            t = dg.temperature(i, n, t_min, t_max)
            np.testing.assert_array_equal(logits / np.asarray(t), ref)
            temps.append(float(t))
        assert temps[0] == pytest.approx(t_max) and temps[-1] == pytest.approx(t_min + (t_max - t_min) / n)
    batched = dg.temperature(jnp.array([0, 47]), 48, 0.4, 0.8)
    assert batched.shape == (2,) and float(batched[0]) == pytest.approx(0.8)


def canvas_logits(seed: int, B: int = 6, Cn: int = 32, V: int = 40) -> np.ndarray:
    """Logits whose positions range from near-certain to flat (entropies from ~0 to ~log V), per row a different
    mix, so the entropy bound accepts from one position to many."""
    rng = np.random.default_rng(seed)
    sharp = rng.uniform(0.0, 14.0, (B, Cn, 1)) * (np.arange(B)[:, None, None] + 1) / B
    z = rng.normal(0, 1, (B, Cn, V))
    z[..., 0] += sharp[..., 0] * 2
    return z.astype(np.float32)


def test_accepted_sets_are_entropy_bound_samplers():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (EntropyBoundSampler,
                                                                                EntropyBoundSamplerConfig)

    counts = []
    for seed, bound in ((16, 0.1), (17, 0.5), (18, 2.0), (19, 0.01)):
        z = canvas_logits(seed)
        sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), z.shape[1], z.shape[2], 48)
        cur, den = torch.zeros(z.shape[:2], dtype=torch.long), torch.ones(z.shape[:2], dtype=torch.long)
        ref = sampler.accept_canvas(cur, den, torch.from_numpy(z), 0).numpy() == 1
        ours = np.asarray(dg.accept(jnp.asarray(z), bound))
        np.testing.assert_array_equal(ours, ref)
        counts += ref.sum(1).tolist()
    assert min(counts) == 1 and max(counts) >= 10 and len(set(counts)) > 5  # from one position to many
    z = canvas_logits(20)
    per_row = np.asarray(dg.accept(jnp.asarray(z), jnp.array([0.01, 0.1, 0.5, 1.0, 2.0, 4.0], jnp.float32)))
    assert (np.diff(per_row.sum(1)) >= 0).all()  # a per-row bound, larger bounds accept more


def peaked(argmax: np.ndarray, target: np.ndarray, V: int) -> np.ndarray:
    """Logits [B, C, V]: row b peaked at argmax[b] so that each position's entropy is target[b] (bisection on the
    peak's height; the rest of the row flat)."""
    def H(height):
        p = np.exp(np.concatenate([[height], np.zeros(V - 1)]))
        p /= p.sum()
        return -(p * np.log(p)).sum()

    heights = []
    for t in target:
        lo, hi = 0.0, 60.0
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if H(mid) > t else (lo, mid)
        heights.append((lo + hi) / 2)
    B, Cn = argmax.shape
    z = np.zeros((B, Cn, V), np.float32)
    z[np.arange(B)[:, None], np.arange(Cn)[None, :], argmax] = np.array(heights, np.float32)[:, None]
    return z


def test_localleap_uniform_accepts_the_bound_and_an_anchors_near_neighbours():
    """localleap_uniform over per-position entropies: the entropy bound's set (clause 1), plus positions within
    `radius` of an accepted anchor (entropy <= anchor_entropy) whose entropy is <= relaxed_entropy (clause 2); a
    row whose lowest entropy is no anchor accepts the bound's set alone, and the tokens are the sample's."""
    import localleap_jax as ll
    from localleap_jax.rules.canvas import CanvasSignals

    Cn, V = 12, 40
    H = np.full((2, Cn), 2.0)
    H[:, [1, 3, 5, 9]] = [0.8, 0.01, 0.3, 0.3]  # row 0: an anchor at 3; 5 near it, 9 far, 1 near but too uncertain
    H[1, 3] = 0.2  # row 1: the lowest entropy is no anchor
    z = jnp.asarray(peaked(np.zeros((2 * Cn, 1), int), H.reshape(-1), V).reshape(2, Cn, V))
    rule = ll.rules.LocalLeapUniform(entropy_bound=0.005, anchor_entropy=0.1, relaxed_entropy=0.5, radius=2)
    argmax = jnp.argmax(z, axis=-1)
    sample = (argmax + 1) % V
    s = CanvasSignals(logits=z, sample=sample, argmax=argmax, tokens=argmax, step=jnp.zeros((2,), jnp.int32))
    decision, _ = rule.update(s, rule.init(2, Cn, V))
    codes = np.asarray(decision.accept)
    assert {i: rule.clause_names[codes[0, i] - 1] for i in np.flatnonzero(codes[0])} == {3: "bound", 5: "near_anchor"}
    assert {i: rule.clause_names[codes[1, i] - 1] for i in np.flatnonzero(codes[1])} == {3: "bound"}
    np.testing.assert_array_equal(np.asarray(decision.tokens), np.asarray(sample))  # greedy = 0: the sample
    eb = ll.rules.EntropyBound(entropy_bound=0.005)
    np.testing.assert_array_equal(np.asarray(eb.update(s, eb.init(2, Cn, V))[0].accept) > 0, codes == 1)


def test_stop_decisions_are_stable_and_confident_criterions():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import StableAndConfidentStoppingCriteria

    rng = np.random.default_rng(21)
    B, Cn, V, threshold = 4, 6, 12, 0.05
    target = threshold * np.array([0.3, 0.9, 1.1, 3.0])  # mean entropies on both sides of the threshold
    decisions = set()
    for stability in (0, 1, 2):
        ref = StableAndConfidentStoppingCriteria(stability_threshold=stability, confidence_threshold=threshold)
        history = dg.init_history(B, stability, Cn)
        base = rng.integers(0, V, (B, Cn))
        for step in range(8):
            argmax = base.copy()
            argmax[step % B] = rng.integers(0, V, Cn)  # one row changes its mind each step
            z = peaked(argmax, np.roll(target, step // 4), V)
            expected = ref(torch.from_numpy(argmax), torch.from_numpy(z)).numpy()
            got, history = dg.stop(jnp.asarray(argmax), history, jnp.asarray(z), threshold)
            np.testing.assert_array_equal(np.asarray(got), expected)
            decisions |= {(stability, bool(d)) for d in expected}
    assert decisions == {(s, d) for s in (0, 1, 2) for d in (False, True)}  # each setting stops and goes on


# ---------------------------------------------------------------- the pieces as a generation


def eager_generate(params, config, ids, mask, noise, *, steps, t_min, t_max, bound, stability, confidence, eos, pad):
    """transformers' generate (greedy sampling) written eagerly with this module's pieces, as the module docstring
    says a generation calls them: the reference the compiled canvas loop can be checked against. noise [B, J,
    steps + 1, C]: each canvas's initial draw, then the renoise after each pass. Returns (generated tokens
    [B, J * C] with transformers' padding after EOS, decoder passes per row, how many kept canvases differ from
    the last sampled one)."""
    B, J = noise.shape[:2]
    cache = dg.init_cache(config, B, ids.shape[1] + J * C)
    _, cache = dg.encode_into(params, cache, jnp.asarray(ids), jnp.asarray(mask), config)
    finished, passes, out, differ = np.zeros(B, bool), np.zeros(B, int), [], 0
    for j in range(J):
        canvas, argmax, soft, z_prev = jnp.asarray(noise[:, j, 0]), jnp.asarray(noise[:, j, 0]), None, None
        history, done = dg.init_history(B, stability, C), np.zeros(B, bool)
        for i in range(steps):
            passes += ~(done | finished)
            z = dg.decode(params, cache, canvas, config, soft) / dg.temperature(i, steps, t_min, t_max)
            a = jnp.argmax(z, axis=-1)  # greedy: the sample is the argmax
            new = jnp.where(dg.accept(z, bound), a, noise[:, j, i + 1])
            frozen = jnp.asarray(done)  # rows already done keep their argmax, canvas and logits
            a = jnp.where(frozen[:, None], argmax, a)
            new = jnp.where(frozen[:, None], canvas, new)
            z = z if z_prev is None else jnp.where(frozen[:, None, None], z_prev, z)
            stop_now, history = dg.stop(a, history, z, confidence)
            done |= np.asarray(stop_now)
            canvas, argmax, z_prev, soft = new, a, z, dg.soft_embedding(params, z, config)
            if done.all():
                break
        kept, before = np.asarray(argmax).copy(), finished.copy()  # the argmax, not the sampled canvas
        differ += int((kept != np.asarray(canvas)).any(axis=1)[~finished].sum())
        finished |= np.isin(kept, eos).any(axis=1) | (j == J - 1)
        kept[before] = pad  # rows ended on an earlier canvas: pad
        is_eos = np.isin(kept, eos)
        seen = np.cumsum(is_eos, axis=1)
        kept[(finished & ~before)[:, None] & (seen > 0) & ~((seen == 1) & is_eos)] = pad  # after the first EOS
        out.append(kept)
        if finished.all():
            break
        _, cache = dg.encode_into(params, cache, jnp.asarray(kept), jnp.ones(kept.shape, bool), config)
    return np.concatenate(out, axis=1), passes, differ


@pytest.mark.parametrize("stability, confidence, bound, t_min, t_max", [(0, 0.05, 0.5, 0.01, 0.03),
                                                                       (1, 0.5, 0.1, 0.05, 0.1)])
def test_the_pieces_make_transformers_generate(monkeypatch, stability, confidence, bound, t_min, t_max):
    """transformers' generate with its random draws supplied (canvas_noise) and the sampler greedy, against
    `eager_generate`: the same tokens and decoder passes per row, on a run with early stops at several steps
    (stability 0) or none (stability 1, where the last pass leaves positions re-noised, so keeping the argmax
    rather than the sampled canvas shows), rows ending on EOS at different canvases and left padding. The
    self-conditioning MLP is damped: at low temperature its feedback multiplies fp32 noise by ~5 a step on
    random weights, and two correct implementations part ways after a few steps."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    hf = randomized(DiffusionGemmaForBlockDiffusion(hf_config()), seed=1)
    with torch.no_grad():
        hf.model.decoder.self_conditioning.down_proj.weight.mul_(0.1)
    config = read_config(hf.config.to_dict())
    params = params_from_state(hf.state_dict(), config)
    hf.set_attn_implementation("sdpa")  # its generate builds an integer-typed mask under eager attention
    B, J, N = 3, 3, 10
    ids, mask = batch(30, [7, 5, 3], 7)
    noise = np.random.default_rng(31).integers(0, VOCAB, (B, J, N + 1, C))
    settings = dict(steps=N, t_min=t_min, t_max=t_max, bound=bound, stability=stability, confidence=confidence)
    eos = [206, 74]

    ref_tokens, ref_passes = hf_generate(monkeypatch, hf, ids, mask, noise, eos=eos, pad=0, **settings)
    tokens, passes, differ = eager_generate(params, config, ids, mask, noise, eos=eos, pad=0, **settings)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(passes, ref_passes)
    ended = (tokens == 0).any(axis=1)
    assert ended.any() and not ended.all()  # some rows ended on EOS, some ran every canvas
    if stability == 0:
        assert len(set(passes.tolist())) == B and (passes % N).any()  # stops at different steps
    else:
        assert (passes % N == 0).all() and differ > 0


# ---------------------------------------------------------------- the compiled loop (ll.generate)


def hf_generate(monkeypatch, hf, ids, mask, noise, *, steps, t_min, t_max, bound, stability, confidence, eos, pad):
    """transformers' generate with `noise` [B, J, steps + 1, C] as its draws (each canvas's initial draw, then the
    renoise after each pass) and its sample the argmax: (generated tokens [B, J * C], padded with `pad` past where
    every row ended, decoder passes per row as it counts them)."""
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as generation

    where, seen = {"canvas": -1, "step": 0}, {}
    per_forward = generation.DiffusionGemmaGenerationMixin._compute_tokens_per_forward

    def initialize_canvas(self, batch_size, device):  # once per canvas
        where["canvas"], where["step"] = where["canvas"] + 1, 0
        return torch.from_numpy(noise[:, where["canvas"], 0])

    def renoise_canvas(self, accepted, cur_step):  # after every pass
        where["step"] += 1
        fresh = torch.from_numpy(noise[:, where["canvas"], where["step"]])
        return torch.where(self.accepted_token_mask, accepted, fresh)

    def counted(input_ids, passes, initial, pad_id):  # the decoder passes per row
        seen["passes"] = passes.numpy().copy()
        return per_forward(input_ids, passes, initial, pad_id)

    with monkeypatch.context() as m:
        m.setattr(generation.EntropyBoundSampler, "initialize_canvas", initialize_canvas)
        m.setattr(generation.EntropyBoundSampler, "renoise_canvas", renoise_canvas)
        m.setattr(generation.DiffusionGemmaGenerationMixin, "_compute_tokens_per_forward", staticmethod(counted))
        m.setattr(torch, "multinomial", lambda probs, num_samples: probs.argmax(-1, keepdim=True))
        with torch.no_grad():
            ref = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                              max_new_tokens=noise.shape[1] * C, max_denoising_steps=steps, t_min=t_min, t_max=t_max,
                              sampler_config=generation.EntropyBoundSamplerConfig(entropy_bound=bound),
                              stability_threshold=stability, confidence_threshold=confidence, pad_token_id=pad,
                              eos_token_id=list(eos))
    tokens = ref.sequences[:, ids.shape[1]:].numpy()
    tokens = np.pad(tokens, ((0, 0), (0, noise.shape[1] * C - tokens.shape[1])), constant_values=pad)
    return tokens, seen["passes"]


@pytest.fixture(scope="module")
def damped():
    """(transformers model, an ll.Model on its weights): `pair`'s model with the self-conditioning MLP damped (at low
    temperature its feedback multiplies fp32 noise by ~5 a step on random weights, and two correct
    implementations part ways after a few steps), ending rows on EOS ids 206 and 74 (ids a random canvas holds
    often enough for rows to end at different canvases)."""
    import dataclasses

    from localleap_jax.loaded import Model
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    hf = randomized(DiffusionGemmaForBlockDiffusion(hf_config()), seed=1)
    with torch.no_grad():
        hf.model.decoder.self_conditioning.down_proj.weight.mul_(0.1)
    config = dataclasses.replace(read_config(hf.config.to_dict()), eos_token_ids=(206, 74))
    hf.set_attn_implementation("sdpa")  # its generate builds an integer-typed mask under eager attention
    return hf, Model(config, params_from_state(hf.state_dict(), config), None)


@pytest.mark.parametrize("stability, confidence, bound, t_min, t_max", [(0, 0.05, 0.5, 0.01, 0.03),
                                                                       (1, 0.5, 0.1, 0.05, 0.1)])
def test_the_compiled_loop_is_transformers_generate(monkeypatch, damped, stability, confidence, bound, t_min,
                                                    t_max):
    """ll.generate with the entropy_bound rule (greedy) and the draws supplied (canvas_noise) against transformers'
    generate with the same draws: the same generated tokens and decoder passes per row, on a left-padded batch
    of 3 whose rows end on EOS at different canvases (or run every canvas), with early stops at different
    passes (stability 0) or none (stability 1: every canvas runs all its passes, re-noising each time). Each row
    alone (its own program, its own draws) and through 2 slots (continuous batching) decodes as it does in the
    batch, and the re-noise draws matter."""
    import localleap_jax as ll
    from localleap_jax.decode.config import DecodeConfig

    hf, model = damped
    B, J, N = 3, 3, 10
    ids, mask = batch(30, [7, 5, 3], 7)
    noise = np.random.default_rng(31).integers(0, VOCAB, (B, J, N + 1, C))
    settings = dict(steps=N, t_min=t_min, t_max=t_max, bound=bound, stability=stability, confidence=confidence)
    ref_tokens, ref_passes = hf_generate(monkeypatch, hf, ids, mask, noise, eos=(206, 74), pad=0, **settings)

    rule = ll.rules.EntropyBound(entropy_bound=bound, t_min=t_min, t_max=t_max, max_denoising_steps=N,
                                 stability_threshold=stability, confidence_threshold=confidence, greedy=1)
    cfg = DecodeConfig(strategy=rule, gen_length=J * C, block_length=C)
    out = ll.generate(model, ids, mask, cfg, jax.random.key(0), canvas_noise=noise)
    tokens, passes = np.asarray(out.tokens)[:, ids.shape[1]:], np.asarray(out.nfe)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(passes, ref_passes)
    # the case happened: rows end on EOS at different canvases, or run every canvas
    ends = [int(np.argmax(np.isin(t, (206, 74)))) // C if np.isin(t, (206, 74)).any() else J for t in tokens]
    assert len(set(ends)) >= 2 and min(ends) < J and max(ends) >= 1, ends
    if stability == 0:  # early stops, at different passes
        assert len(set(passes.tolist())) == B and (passes % N).any()
    else:
        assert (passes % N == 0).all() and passes.max() > N
    for b in range(B):  # each row alone
        keep = mask[b]
        alone = ll.generate(model, ids[b:b + 1, keep], None, cfg, jax.random.key(0), canvas_noise=noise[b:b + 1])
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0, keep.sum():], tokens[b])
        assert int(alone.nfe[0]) == passes[b]
    slotted = ll.generate(model, ids, mask, cfg, jax.random.key(0), canvas_noise=noise, slots=2)  # a slot refilled
    np.testing.assert_array_equal(np.asarray(slotted.tokens)[:, ids.shape[1]:], tokens)
    np.testing.assert_array_equal(np.asarray(slotted.nfe), passes)
    # the re-noise draws matter: other re-noise after each pass, other tokens
    other = noise.copy()
    other[:, :, 1:] = np.random.default_rng(32).integers(0, VOCAB, other[:, :, 1:].shape)
    changed = ll.generate(model, ids, mask, cfg, jax.random.key(0), canvas_noise=other)
    assert (np.asarray(changed.tokens)[:, ids.shape[1]:] != tokens).any()


def test_localleap_uniform_in_the_loop_is_entropy_bound_without_relaxed_neighbours(damped):
    """localleap_uniform through the compiled loop (trace on): with relaxed_entropy 0 no neighbour is admitted and
    it decodes as entropy_bound (tokens, passes, the bound's accepted positions per pass); with a relaxed bound
    the anchors' neighbours are accepted (clause near_anchor) and the generation changes."""
    import localleap_jax as ll
    from localleap_jax.decode.config import DecodeConfig

    _, model = damped
    B, J, N = 3, 3, 10
    ids, mask = batch(30, [7, 5, 3], 7)
    noise = np.random.default_rng(31).integers(0, VOCAB, (B, J, N + 1, C))
    common = dict(entropy_bound=0.1, t_min=0.05, t_max=0.1, max_denoising_steps=N, stability_threshold=1,
                  confidence_threshold=0.5, greedy=1)

    def go(rule):
        out = ll.generate(model, ids, mask, DecodeConfig(strategy=rule, gen_length=J * C, block_length=C),
                          jax.random.key(0), canvas_noise=noise, trace=True)
        t = out.trace
        return np.asarray(out.tokens), np.asarray(out.nfe), {n: t.clause == k + 1 for k, n in enumerate(t.clause_names)}

    tokens, passes, clauses = go(ll.rules.EntropyBound(**common))
    same = go(ll.rules.LocalLeapUniform(**common, relaxed_entropy=0.0))
    np.testing.assert_array_equal(same[0], tokens)
    np.testing.assert_array_equal(same[1], passes)
    np.testing.assert_array_equal(same[2]["bound"], clauses["bound"])
    assert not same[2]["near_anchor"].any() and clauses["bound"].sum() > B * J
    relaxed = go(ll.rules.LocalLeapUniform(**common, anchor_entropy=0.5, relaxed_entropy=2.0, radius=2))
    assert relaxed[2]["near_anchor"].sum() > 0 and (relaxed[0] != tokens).any()


def test_a_canvas_rules_answers_depend_on_the_seed_and_the_batch():
    """A canvas rule draws (its noise) with greedy sampling: an answer cache's key counts the seed, and the batch (a
    row's draws follow its place in it), as for sampling at temperature > 0."""
    import localleap_jax as ll
    from localleap_jax.decode.config import DecodeConfig
    from localleap_jax.lm_eval.identity import rows_interact

    canvas = DecodeConfig(strategy=ll.rules.EntropyBound(greedy=1), gen_length=2 * C, block_length=C)
    assert canvas.draws and rows_interact(canvas)
    assert not rows_interact(DecodeConfig(gen_length=2 * C, block_length=C))


@pytest.mark.parametrize("case, words", [
    ("masked model, canvas rule", "entropy_bound is a canvas rule, for a uniform-noise canvas model"),
    ("canvas model, masked rule", "this model decodes uniform-noise canvases (no mask token): use a canvas rule"),
    ("cache", "cache='prefix': a canvas rule keeps its model's encoder K/V"),
    ("noise shape", "canvas_noise must be token ids [batch, canvases, max_denoising_steps + 1, block_length] = "
                    "[3, 2, 5, 8]; got int64 [3, 2, 2, 8]"),
    ("noise ids", "canvas_noise holds ids outside [0, 300)"),
    ("block length", "block_length must be 8, got 4"),
    ("temperature", "temperature=0.5: entropy_bound samples at its own schedule"),
    ("no rng", "entropy_bound draws its canvases' noise and samples: pass rng="),
])
def test_what_a_canvas_rule_cannot_take_is_refused_in_one_line(damped, case, words):
    import localleap_jax as ll
    from localleap_jax.decode.config import DecodeConfig

    from stubs import config as masked_config

    _, model = damped
    ids, mask = batch(30, [7, 5, 3], 7)
    noise = np.random.default_rng(31).integers(0, VOCAB, (3, 2, 5, C))
    eb = ll.rules.EntropyBound(max_denoising_steps=4)
    cfg = DecodeConfig(strategy=eb, gen_length=2 * C, block_length=C)
    key = jax.random.key(0)
    run = {
        "masked model, canvas rule": lambda: cfg.validate(masked_config()),
        "canvas model, masked rule": lambda: ll.generate(model, ids, mask, DecodeConfig(gen_length=2 * C,
                                                                                       block_length=C)),
        "cache": lambda: ll.generate(model, ids, mask, DecodeConfig(strategy=eb, gen_length=2 * C, block_length=C,
                                                                    cache="prefix"), key),
        "noise shape": lambda: ll.generate(model, ids, mask, cfg, key, canvas_noise=noise[:, :, :2]),
        "noise ids": lambda: ll.generate(model, ids, mask, cfg, key, canvas_noise=noise + VOCAB),
        "block length": lambda: ll.generate(model, ids, mask, DecodeConfig(strategy=eb, gen_length=2 * C,
                                                                           block_length=C // 2), key),
        "temperature": lambda: ll.generate(model, ids, mask, DecodeConfig(strategy=eb, gen_length=2 * C,
                                                                          block_length=C, temperature=0.5), key),
        "no rng": lambda: ll.generate(model, ids, mask, cfg),
    }[case]
    with pytest.raises(DecodeError) as e:
        run()
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------- conversion and loading


def test_convert_and_load_round_trip(tmp_path):
    """save_pretrained (safetensors, with the vision tower) -> python -m convert -> ll.load: the text weights in
    their places (the loaded model's decoder logits are transformers'), the vision tower left out."""
    import localleap_jax as ll
    from convert import main
    from localleap_jax.families import make_tokenizer
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    hf = randomized(DiffusionGemmaForBlockDiffusion(hf_config()), seed=22)
    src, out = tmp_path / "hf", tmp_path / "out"
    hf.save_pretrained(src)
    make_tokenizer("diffusion_gemma", TOKENIZER_CORPUS, vocab_size=VOCAB).save_pretrained(src)
    from safetensors import safe_open

    with safe_open(src / "model.safetensors", "np") as f:
        stored = list(f.keys())
    assert any(k.startswith("model.encoder.vision_tower.") for k in stored)
    assert main([str(src), str(out)]) == 0
    m = ll.load(out, dtype="float32")
    assert m.config.family == "diffusion_gemma" and m.config.canvas_length == C
    assert m.config.mask_token_id == m.tokenizer.hf.convert_tokens_to_ids("<mask>")
    assert json.loads((out / "manifest.json").read_text())["family"] == "diffusion_gemma"
    ids, mask = batch(23, [9, 6], 9)
    canvas = np.random.default_rng(24).integers(0, VOCAB, (2, C))
    ours = dg.decoder_logits(m.params, ids, mask, canvas, m.config)
    np.testing.assert_allclose(np.asarray(ours), hf_decoder_logits(hf, ids, mask, canvas), atol=FP32_TOL, rtol=0)
    encoder_scalars = [float(m.params["canvas_layers"][i]["encoder_layer_scalar"][0]) for i in (0, 2, 3)]  # the sliding ones
    ref = [float(hf.model.encoder.language_model.layers[i].layer_scalar) for i in (0, 2, 3)]
    np.testing.assert_allclose(encoder_scalars, ref, rtol=1e-6)


def test_tied_copies_convert_when_equal_and_are_refused_in_one_line_when_not(tmp_path, pair):
    """An export without de-duplication also writes the tied tensors: lm_head.weight (the embedding) and the encoder's
    weights under model.encoder.language_model.* (transformers' _tied_weights_keys). Copies equal to their source
    convert to the same parameters as without them (issue #47: refused before as unexpected tensors); a copy that
    differs is refused in one line naming it and its source, with nothing left behind."""
    import localleap_jax as ll
    from localleap_jax.convert_hf import ConversionError, convert
    from localleap_jax.families import make_tokenizer
    from safetensors.numpy import load_file, save_file

    hf, config, _ = pair
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    make_tokenizer("diffusion_gemma", TOKENIZER_CORPUS, vocab_size=VOCAB).save_pretrained(src)
    stored = load_file(src / "model.safetensors")
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    copies = {k: state[k] for k in state if k == "lm_head.weight" or k.startswith("model.encoder.language_model.")}
    assert "lm_head.weight" not in stored and not set(copies) - {"lm_head.weight"} & {
        k for k in stored if not k.endswith("layer_scalar")}  # save_pretrained de-duplicated them
    assert len(copies) > 50 and "model.encoder.language_model.layers.3.experts.gate_up_proj" in copies
    save_file({**stored, **copies}, src / "model.safetensors")
    convert(str(src), str(tmp_path / "out"), progress=False)
    m = ll.load(tmp_path / "out", dtype="float32")
    # The converted config is the reference's but for the (unused) mask id the tokenizer names; the reference's config
    # and the decoder test's shapes reuse its compiled program.
    assert m.config == dataclasses.replace(config, mask_token_id=m.config.mask_token_id)
    ids, mask = batch(1, [11, 7], 11)
    canvas = np.random.default_rng(2).integers(0, VOCAB, (2, C))
    np.testing.assert_allclose(np.asarray(dg.decoder_logits(m.params, ids, mask, canvas, config)),
                               hf_decoder_logits(hf, ids, mask, canvas), atol=FP32_TOL, rtol=0)

    name = "model.encoder.language_model.layers.1.self_attn.k_proj.weight"
    changed = {**copies, name: copies[name] + np.float32(1e-3)}
    save_file({**stored, **changed}, src / "model.safetensors")
    with pytest.raises(ConversionError) as e:
        convert(str(src), str(tmp_path / "bad"), progress=False)
    assert str(e.value).startswith(f"{name} differs from model.decoder.layers.1.self_attn.k_proj.weight, the tensor "
                                   "it is tied to") and "\n" not in str(e.value)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))


def test_parameter_tree_splits_experts_and_vocabulary_only():
    """partition.spec_for on this tree: routed experts over "expert" on their expert axis, the embedding over
    "model" by vocabulary, everything else replicated (the stacks are not "blocks")."""
    from localleap_jax.checkpoint.reading import abstract_params
    from localleap_jax.partition import param_specs, path_names

    config = read_config(released_form())
    specs = param_specs(abstract_params(config, jnp.float32), model_size=2, expert_size=2)
    flat = {"/".join(path_names(p)): s for p, s in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))[0]}
    assert flat["sliding/moe/experts/gate_proj"] == jax.sharding.PartitionSpec(None, "expert", None, None)
    assert flat["wte/embedding"] == jax.sharding.PartitionSpec("model", None)
    split = {k for k, s in flat.items() if any(a is not None for a in s)}
    assert split == {"wte/embedding"} | {f"{kind}/moe/experts/{n}" for kind in ("sliding", "full")
                                         for n in ("gate_proj", "up_proj", "down_proj")}
