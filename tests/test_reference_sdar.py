"""The SDAR oracle (oracles/sdar.py) checked on its own: tiny random Qwen3-shaped checkpoints
for the network and the block-causal mask, stub logits for the exact branches of SDAR's generate loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oracles import sdar as S

BLOCK = 4
MASK = 49  # the last id of the tiny vocabulary


def tiny_config(**over) -> dict:
    cfg = {"model_type": "sdar", "architectures": ["SDARForCausalLM"], "vocab_size": 50, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32,  # != hidden / heads = 16, as SDAR's configs allow
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 128,
           "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
           "tie_word_embeddings": False, "block_size": BLOCK, "mask_token_id": MASK, "fuse_cross_entropy": True}
    cfg.update(over)
    return cfg


def tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, hd, V, F = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    out = {"model.embed_tokens.weight": w(V, d, s=1.0), "model.norm.weight": 1 + w(d, s=0.1)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": w(nh * hd, d), p + "self_attn.k_proj.weight": w(nkv * hd, d),
                p + "self_attn.v_proj.weight": w(nkv * hd, d), p + "self_attn.o_proj.weight": w(d, nh * hd),
                p + "self_attn.q_norm.weight": 1 + w(hd, s=0.1), p + "self_attn.k_norm.weight": 1 + w(hd, s=0.1),
                p + "mlp.gate_proj.weight": w(F, d), p + "mlp.up_proj.weight": w(F, d),
                p + "mlp.down_proj.weight": w(d, F), p + "input_layernorm.weight": 1 + w(d, s=0.1),
                p + "post_attention_layernorm.weight": 1 + w(d, s=0.1)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = w(V, d)
    return out


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return S.sdar_torch_model(cfg, tiny_tensors(cfg))


def _ids(L: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MASK, size=(1, L))


def _logits(model, ids, mask=None):
    return S.block_causal_logits(model, ids, np.ones(ids.shape, bool) if mask is None else mask, BLOCK)


# ---------------------------------------------------------------------------- the network


def test_qwen3_shapes_and_head_dim(model):
    attn = model.model.layers[0].self_attn
    assert model.config.head_dim == 32 and attn.q_proj.weight.shape == (4 * 32, 64)
    assert attn.k_proj.weight.shape == (2 * 32, 64) and attn.q_proj.bias is None
    assert attn.q_norm.weight.shape == (32,)
    assert model.config._attn_implementation == "eager" and not model.training
    assert model.lm_head.weight.dtype == torch.float32


def test_tied_and_untied_heads_load():
    tied_cfg = tiny_config(tie_word_embeddings=True)
    tensors = tiny_tensors(tied_cfg, seed=3)
    assert "lm_head.weight" not in tensors
    tied = S.sdar_torch_model(tied_cfg, tensors)
    assert torch.equal(tied.lm_head.weight, torch.from_numpy(tensors["model.embed_tokens.weight"]))
    # The same network written out untied, with the embedding as its head, gives the same logits.
    untied = S.sdar_torch_model(tiny_config(), tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"]})
    ids = _ids(10)
    np.testing.assert_array_equal(_logits(tied, ids), _logits(untied, ids))
    # An untied checkpoint's own head is used.
    other = tensors | {"lm_head.weight": np.ones_like(tensors["model.embed_tokens.weight"])}
    assert not np.allclose(_logits(S.sdar_torch_model(tiny_config(), other), ids), _logits(untied, ids))
    with pytest.raises(ValueError, match="no lm_head.weight"):
        S.sdar_torch_model(tiny_config(), tensors)
    with pytest.raises(ValueError, match="differs"):
        S.sdar_torch_model(tied_cfg, other)


@pytest.mark.parametrize("over, match", [({"model_type": "sdar_moe"}, "dense SDAR"),
                                         ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
                                         ({"use_sliding_window": True}, "sliding"),
                                         ({"attention_bias": True}, "bias"),
                                         ({"head_dim": None}, "head_dim")])
def test_refuses_what_it_cannot_run(over, match):
    cfg = tiny_config(**over)
    with pytest.raises(ValueError, match=match):
        S.sdar_torch_model(cfg, tiny_tensors(tiny_config()))


# ---------------------------------------------------------------------------- the block-causal mask


def test_mask_is_block_causal(model):
    ids = _ids(12)
    base = _logits(model, ids)
    later = ids.copy()
    later[0, 8:] = (later[0, 8:] + 7) % MASK  # block 2 changes
    got = _logits(model, later)
    np.testing.assert_allclose(got[0, :8], base[0, :8], rtol=0, atol=1e-6)  # blocks 0 and 1: untouched
    assert not np.allclose(got[0, 8:], base[0, 8:], atol=1e-3)
    inside = ids.copy()
    inside[0, 3] = (inside[0, 3] + 7) % MASK  # the last token of block 0
    got = _logits(model, inside)
    # Bidirectional inside a block: position 0 sees position 3; every later block sees block 0.
    for p in (0, 1, 2, 4, 11):
        assert not np.allclose(got[0, p], base[0, p], atol=1e-4), p
    # ... which an ordinary causal forward would not do: the mask really is applied.
    with torch.no_grad():
        causal = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert not np.allclose(causal[0, :3], base[0, :3], atol=1e-4)


def test_left_padding_matches_unpadded(model):
    ids = _ids(10, seed=5)
    alone = _logits(model, ids)
    for pad in (1, 3, 6):
        row = np.concatenate([np.full((1, pad), 7), ids], axis=1)
        mask = np.concatenate([np.zeros((1, pad), bool), np.ones(ids.shape, bool)], axis=1)
        got = _logits(model, row, mask)
        np.testing.assert_allclose(got[0, pad:], alone[0], rtol=0, atol=2e-5)
    # A batch of differently padded rows: each row on its own grid.
    rows = np.stack([np.concatenate([[3, 3], ids[0]]), np.concatenate([ids[0], ids[0, :2]])])
    mask = np.ones(rows.shape, bool)
    mask[0, :2] = False
    got = _logits(model, rows, mask)
    np.testing.assert_allclose(got[0, 2:], alone[0], rtol=0, atol=2e-5)
    # Row 1 is unpadded with 2 extra tokens: they join block 2 (positions 8..11), so blocks 0-1 agree.
    np.testing.assert_allclose(got[1, :8], alone[0, :8], rtol=0, atol=2e-5)
    assert not np.allclose(got[1, 8:10], alone[0, 8:10], atol=1e-4)


def test_block_causal_mask_grid():
    allowed, pos = S.block_causal_mask(np.array([[False, True, True, True, True, True]]), 2)
    assert pos.tolist() == [[0, 0, 1, 2, 3, 4]]
    # real keys 1..5 on grid blocks {0,0,1,1,2}; query 2 (grid 1, block 0) sees keys 1, 2 only
    assert allowed[0, 2].tolist() == [False, True, True, False, False, False]
    assert allowed[0, 3].tolist() == [False, True, True, True, True, False]
    assert allowed[0, 0].tolist() == [True, False, False, False, False, False]  # a pad query sees itself


# ---------------------------------------------------------------------------- the generate loop


def test_num_transfer_tokens():
    assert S.get_num_transfer_tokens(4, 4).tolist() == [1, 1, 1, 1]
    assert S.get_num_transfer_tokens(8, 3).tolist() == [3, 3, 2]
    assert S.get_num_transfer_tokens(4, 1).tolist() == [4]
    assert S.get_num_transfer_tokens(4, 8).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def _no_mask_pred(model):
    """The tiny model's logits with the mask id never the argmax (a trained SDAR practically never picks it;
    the oracle itself, like SDAR, does not exclude it)."""
    inner = S.sdar_logits_fn(model, BLOCK)

    def fn(ids):
        out = inner(ids).copy()
        out[..., MASK] = -1e9
        return out

    return fn


@pytest.mark.parametrize("strategy", S.STRATEGIES)
def test_counts_add_up(model, strategy):
    prompt = _ids(6, seed=2)[0]  # P = 6, B = 4: one prefilled block, the prompt's last 2 tokens share block 1
    toks, counts = S.block_diffusion_generate(_no_mask_pred(model), prompt, mask_id=MASK, gen_length=8,
                                              block_length=BLOCK, denoising_steps=4, remasking_strategy=strategy,
                                              confidence_threshold=0.9)
    assert toks.shape == (16,)  # ceil(14 / 4) = 4 blocks
    np.testing.assert_array_equal(toks[:6], prompt)
    assert not (toks == MASK).any()
    assert counts["prefill"] == 1 and counts["blocks"] == 3 and counts["store"] == 3 and counts["stopped"] == 0
    assert counts["nfe"] == counts["prefill"] + counts["denoise"] + counts["store"]
    if strategy == "low_confidence_static":  # one commit per pass: as many passes as masks (2 + 4 + 4)
        assert counts["denoise"] == 10
    else:
        assert 3 <= counts["denoise"] <= 10


def test_short_prompt_and_stop_ids(model):
    fn = _no_mask_pred(model)
    prompt = _ids(3, seed=4)[0]  # P < B: nothing to prefill
    toks, counts = S.block_diffusion_generate(fn, prompt, mask_id=MASK, gen_length=9, block_length=BLOCK,
                                              denoising_steps=2, remasking_strategy="low_confidence_static")
    assert counts["prefill"] == 0 and counts["blocks"] == 3 and counts["store"] == 3
    assert counts["denoise"] == 1 + 2 + 2  # quota [2, 2]: 1 mask, then 4, then 4
    # Stop on a token generated in the first block: only that block is decoded; later blocks stay masks.
    stop = int(toks[3])
    toks2, counts2 = S.block_diffusion_generate(fn, prompt, mask_id=MASK, gen_length=9, block_length=BLOCK,
                                                denoising_steps=2, remasking_strategy="low_confidence_static",
                                                stop_ids=[stop])
    assert counts2["stopped"] == 1 and counts2["blocks"] == 1 and counts2["store"] == 1
    np.testing.assert_array_equal(toks2[:4], toks[:4])
    assert (toks2[4:] == MASK).all()


def _stub(conf_rows: np.ndarray | None = None, token: int = 0, V: int = 6):
    """logits_fn giving every position the prediction `token`; its probability exactly 1/2 (two equal
    logits, `token` the lower id) or, per block position, conf_rows[i] (other mass on the id after it)."""

    def fn(ids):
        n = ids.shape[1]
        out = np.full((1, n, V), -1e30)
        for i in range(n):
            if conf_rows is None:
                out[0, i, token] = out[0, i, token + 1] = 0.0
            else:
                c = conf_rows[i % len(conf_rows)]
                out[0, i, token], out[0, i, token + 1] = np.log(c), np.log(1 - c)
        return out

    return fn


def test_dynamic_threshold_is_strict():
    prompt = [1, 2, 3, 4]
    run = lambda thr: S.block_diffusion_generate(_stub(), prompt, mask_id=5, gen_length=4, block_length=4,
                                                 denoising_steps=4, remasking_strategy="low_confidence_dynamic",
                                                 confidence_threshold=thr)
    toks, counts = run(0.5)  # every confidence is exactly 0.5: not > 0.5, so one commit per pass (quota 1)
    assert S._greedy(_stub()(np.zeros((1, 1), int))[0])[1][0] == 0.5
    assert counts["denoise"] == 4 and counts["store"] == 1 and toks.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]
    _, counts = run(0.4999)  # all four pass at the first step
    assert counts["denoise"] == 1


@pytest.mark.parametrize("strategy", S.STRATEGIES)
def test_original_topk_overwrites_prompt_tokens(strategy):
    # P = 6, B = 4, one step: quota 4 but block 1 has 2 masks; SDAR's topk(4) also takes prompt positions 4, 5.
    prompt = [1, 2, 3, 4, 3, 2]
    kw = dict(mask_id=5, gen_length=2, block_length=4, denoising_steps=1, remasking_strategy=strategy,
              confidence_threshold=0.99)
    fn = _stub(np.array([0.6, 0.7, 0.8, 0.9]), token=0)
    toks, counts = S.block_diffusion_generate(fn, prompt, commit_only_masked=False, **kw)
    assert toks.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]  # prompt tokens 3, 2 at positions 4, 5 overwritten
    assert counts["denoise"] == 1 and counts["store"] == 1
    toks, counts = S.block_diffusion_generate(fn, prompt, **kw)
    assert toks.tolist() == [1, 2, 3, 4, 3, 2, 0, 0]  # default: only masks commit
    assert counts["denoise"] == 1 and counts["store"] == 1


def test_localleap_rule_inside_sdar_blocks():
    # Block-position confidences [0.95, 0.8, 0.5, 0.8]: LocalLeap(kappa 0.9, tau 0.75, radius 1) commits the
    # anchor 0 and its relaxed neighbour 1, then (no anchor left) its top1 3, then 2: three passes.
    fn = _stub(np.array([0.95, 0.8, 0.5, 0.8]), token=0)
    seen = []
    inner = S.localleap_rule(kappa=0.9, tau=0.75, radius=1)

    def rule(conf, pred, cand, step):
        out = inner(conf, pred, cand, step)
        seen.append((step, np.flatnonzero(out).tolist()))
        return out

    toks, counts = S.block_diffusion_generate(fn, [1, 2, 3, 4], mask_id=5, gen_length=8, block_length=4,
                                              denoising_steps=4, rule=rule)
    assert seen == [(0, [0, 1]), (1, [3]), (2, [2])] * 2
    assert counts["denoise"] == 6 and counts["store"] == 2 and counts["prefill"] == 1
    assert toks.tolist() == [1, 2, 3, 4] + [0] * 8
    # A rule that picks nothing still commits the most confident candidate each pass.
    _, counts = S.block_diffusion_generate(fn, [1, 2, 3, 4], mask_id=5, gen_length=4, block_length=4,
                                           denoising_steps=4, rule=lambda c, p, m, s: np.zeros(len(c), bool))
    assert counts["denoise"] == 4


def test_eager_rule_refuses_rules_it_cannot_feed():
    from oracles import rules as reference_rules

    with pytest.raises(ValueError, match="reads"):
        S.eager_rule(reference_rules.make("eb"))
    with pytest.raises(ValueError, match="schedule"):
        S.eager_rule(reference_rules.make("low_confidence"))


def test_mask_prediction_is_not_hidden():
    # Like SDAR, the oracle may predict the mask id; SDAR's loop would then run past its schedule.
    with pytest.raises(RuntimeError, match="mask id"):
        S.block_diffusion_generate(_stub(token=4), [1, 2, 3, 4], mask_id=4, gen_length=4, block_length=4,
                                   denoising_steps=4, remasking_strategy="low_confidence_static")
