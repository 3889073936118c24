"""The LLaDA2 oracle (oracles/llada2.py) checked on its own: the router against transformers' DeepseekV3 and
GLM4-MoE gates, the attention against a NumPy transcription, the whole network against transformers'
Glm4MoeForCausalLM (the same architecture under other tensor names), the block-causal mask, and the generate
loop on hand-made logits whose commits are worked out in the comments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oracles import llada2 as L2

V, MASK, EOS = 40, 39, 38
BLOCK = 4


def tiny_config(**over) -> dict:
    cfg = {"model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "vocab_size": V, "hidden_size": 32,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "partial_rotary_factor": 0.5, "rotary_dim": 8, "rope_theta": 600000.0, "rms_norm_eps": 1e-6,
           "intermediate_size": 48, "moe_intermediate_size": 8, "num_experts": 8, "num_experts_per_tok": 3,
           "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "num_shared_experts": 1,
           "first_k_dense_replace": 1, "use_bias": False, "use_qkv_bias": False, "norm_head": False,
           "tie_word_embeddings": False, "rope_scaling": None, "score_function": "sigmoid", "norm_topk_prob": True}
    cfg.update(over)
    return cfg


def tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = L2.llada2_config(cfg)
    H, D, F, Fe, E = c.hidden_size, c.head_dim, c.intermediate_size, c.moe_intermediate_size, c.num_experts

    def w(*shape, s=0.25):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    out = {"model.word_embeddings.weight": w(cfg["vocab_size"], H, s=1.0), "model.norm.weight": 1 + w(H, s=0.1),
           "lm_head.weight": w(cfg["vocab_size"], H)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": 1 + w(H, s=0.1), p + "post_attention_layernorm.weight": 1 + w(H, s=0.1),
                p + "attention.query_key_value.weight": w((c.num_heads + 2 * c.num_kv_heads) * D, H),
                p + "attention.query_layernorm.weight": 1 + w(D, s=0.1),
                p + "attention.key_layernorm.weight": 1 + w(D, s=0.1),
                p + "attention.dense.weight": w(H, c.num_heads * D)}
        if i < c.first_k_dense_replace:
            out |= {p + "mlp.gate_proj.weight": w(F, H), p + "mlp.up_proj.weight": w(F, H),
                    p + "mlp.down_proj.weight": w(H, F)}
            continue
        out |= {p + "mlp.gate.weight": w(E, H, s=1.0), p + "mlp.gate.expert_bias": w(E, s=0.3)}
        for e in range(E):
            out |= {p + f"mlp.experts.{e}.gate_proj.weight": w(Fe, H), p + f"mlp.experts.{e}.up_proj.weight": w(Fe, H),
                    p + f"mlp.experts.{e}.down_proj.weight": w(H, Fe)}
        Fs = Fe * c.num_shared_experts
        if Fs:
            out |= {p + "mlp.shared_experts.gate_proj.weight": w(Fs, H),
                    p + "mlp.shared_experts.up_proj.weight": w(Fs, H),
                    p + "mlp.shared_experts.down_proj.weight": w(H, Fs)}
    return out


@pytest.fixture(scope="module")
def tensors():
    return tiny_tensors(tiny_config())


@pytest.fixture(scope="module")
def net(tensors):
    return L2.LLaDA2Network(tiny_config(), tensors)


# ---------------------------------------------------------------------------- the router


def _router_case(seed=3, T=256, H=32, E=8):
    rng = np.random.default_rng(seed)
    h = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32))
    gate = torch.from_numpy((rng.standard_normal((E, H)) * 0.3).astype(np.float32))
    bias = torch.from_numpy((rng.standard_normal(E) * 0.3).astype(np.float32))
    return h, gate, bias


def _reference_router(cls_name, *, E, H, k, n_group, topk_group, scale, norm, gate, bias):
    import transformers

    if cls_name == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router

        cfg = transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
                                            topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=norm)
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router

        cfg = transformers.Glm4MoeConfig(hidden_size=H, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
                                         topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=norm)
    router = Router(cfg)
    router.weight.data.copy_(gate)
    router.e_score_correction_bias.copy_(bias)
    return router


def _by_expert(idx: torch.Tensor, w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    order = idx.argsort(dim=-1)
    return idx.gather(1, order).numpy(), w.gather(1, order).detach().numpy()


@pytest.mark.parametrize("reference", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("k", [3, 1])
def test_router_equals_transformers_group_limited_gate(reference, k):
    E, H, n_group, topk_group, scale = 8, 32, 4, 2, 2.5
    h, gate, bias = _router_case()
    idx, w = L2.route_sigmoid_grouped(h, gate, bias, top_k=k, n_group=n_group, topk_group=topk_group,
                                      routed_scaling_factor=scale)
    # LLaDA2 renormalises exactly when k > 1 (whatever norm_topk_prob says): the reference's flag follows that.
    router = _reference_router(reference, E=E, H=H, k=k, n_group=n_group, topk_group=topk_group, scale=scale,
                               norm=k > 1, gate=gate, bias=bias)
    with torch.no_grad():
        _, ref_w, ref_idx = router(h)
    got_idx, got_w = _by_expert(idx, w)
    want_idx, want_w = _by_expert(ref_idx, ref_w)
    np.testing.assert_array_equal(got_idx, want_idx)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6, atol=1e-7)
    # The case really exercises the bias and the groups: for some tokens the unbiased top-k differs (selection reads
    # the bias), and for some the biased top-k over ALL experts differs (the group limit removed a winner).
    s = torch.sigmoid(h @ gate.T)
    biased = s + bias
    for scores in (s, biased):
        ungrouped = scores.topk(k, dim=-1).indices.sort(-1).values.numpy()
        assert (ungrouped != got_idx).any(axis=1).sum() >= 3
    # The weights come from the UNbiased scores: recomputing them from s by hand agrees, from s + bias does not.
    unbiased = s.gather(1, idx)
    by_hand = (unbiased / unbiased.sum(-1, keepdim=True) if k > 1 else unbiased) * scale
    np.testing.assert_allclose(w.numpy(), by_hand.numpy(), rtol=1e-6)
    if k > 1:
        assert not np.allclose(w.numpy(), (biased.gather(1, idx) / biased.gather(1, idx).sum(-1, keepdim=True)
                                           * scale).numpy(), atol=1e-3)


def test_router_top1_is_not_renormalised():
    h, gate, bias = _router_case(seed=4)
    _, w = L2.route_sigmoid_grouped(h, gate, bias, top_k=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert (w < 2.5 - 1e-3).all()  # sigmoid < 1, times 2.5: a renormalised top-1 would be exactly 2.5


# ---------------------------------------------------------------------------- attention and the network


def _numpy_attention(cfg: dict, t: dict, layer: int, x: np.ndarray, allowed: np.ndarray, pos: np.ndarray):
    """LLaDA2MoeAttention in NumPy float64, one query head and one rotary pair at a time."""
    c = L2.llada2_config(cfg)
    p = f"model.layers.{layer}.attention."
    Hq, Hkv, D, rd = c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim
    B, L, _ = x.shape
    heads = (x @ t[p + "query_key_value.weight"].astype(np.float64).T).reshape(B, L, Hq + 2 * Hkv, D)
    q, k, v = heads[:, :, :Hq], heads[:, :, Hq:Hq + Hkv], heads[:, :, Hq + Hkv:]

    def norm(a, wt):
        return a / np.sqrt((a ** 2).mean(-1, keepdims=True) + c.rms_norm_eps) * wt

    q, k = norm(q, t[p + "query_layernorm.weight"]), norm(k, t[p + "key_layernorm.weight"])

    def rotate(a):
        a = a.copy()
        for i in range(rd // 2):
            ang = pos[:, :, None] * c.rope_theta ** (-2 * i / rd)
            lo, hi = a[..., i].copy(), a[..., i + rd // 2].copy()
            a[..., i], a[..., i + rd // 2] = lo * np.cos(ang) - hi * np.sin(ang), hi * np.cos(ang) + lo * np.sin(ang)
        return a

    q, k = rotate(q), rotate(k)
    out = np.zeros((B, L, Hq, D))
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        s = np.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, kv]) / np.sqrt(D)
        s = np.where(allowed, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, h] = (a / a.sum(-1, keepdims=True)) @ v[:, :, kv]
    return out.reshape(B, L, Hq * D) @ t[p + "dense.weight"].astype(np.float64).T


def test_attention_with_partial_rotary_equals_numpy(tensors):
    cfg = tiny_config()
    net64 = L2.LLaDA2Network(cfg, tensors, dtype=torch.float64)
    x = np.random.default_rng(7).standard_normal((2, 9, 32))
    mask = np.ones((2, 9), bool)
    mask[1, :3] = False
    allowed, pos = L2.block_causal_mask(mask, BLOCK)
    got = net64.attend(1, torch.from_numpy(x), torch.from_numpy(allowed), torch.from_numpy(pos)).numpy()
    want = _numpy_attention(cfg, tensors, 1, x, allowed, pos)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    # The rotary really is partial: rotating all 16 dims changes the answer (so the NumPy side is not vacuous).
    all_dims = _numpy_attention(tiny_config(partial_rotary_factor=1.0), tensors, 1, x, allowed, pos)
    assert not np.allclose(all_dims, want, atol=1e-4)


def glm4_moe_from_llada2(cfg: dict, t: dict):
    """transformers' Glm4MoeForCausalLM holding LLaDA2 tensors (qkv split by heads, experts stacked)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    c = L2.llada2_config(cfg)
    gc = Glm4MoeConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_layers,
                       num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                       partial_rotary_factor=c.rotary_dim / c.head_dim,
                       rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                                        "partial_rotary_factor": c.rotary_dim / c.head_dim},
                       rms_norm_eps=c.rms_norm_eps, n_routed_experts=c.num_experts, num_experts_per_tok=c.top_k,
                       n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                       n_shared_experts=c.num_shared_experts, first_k_dense_replace=c.first_k_dense_replace,
                       norm_topk_prob=True, use_qk_norm=True, attention_bias=False, tie_word_embeddings=False,
                       attn_implementation="eager")
    model = Glm4MoeForCausalLM(gc).eval()
    T = torch.from_numpy
    sd = {"model.embed_tokens.weight": T(t["model.word_embeddings.weight"]),
          "model.norm.weight": T(t["model.norm.weight"]),
          "lm_head.weight": T(t["lm_head.weight"])}
    H, D, Hq, Hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        qkv = t[p + "attention.query_key_value.weight"].reshape(Hq + 2 * Hkv, D, H)
        sd |= {p + "self_attn.q_proj.weight": T(qkv[:Hq].reshape(-1, H).copy()),
               p + "self_attn.k_proj.weight": T(qkv[Hq:Hq + Hkv].reshape(-1, H).copy()),
               p + "self_attn.v_proj.weight": T(qkv[Hq + Hkv:].reshape(-1, H).copy()),
               p + "self_attn.o_proj.weight": T(t[p + "attention.dense.weight"]),
               p + "self_attn.q_norm.weight": T(t[p + "attention.query_layernorm.weight"]),
               p + "self_attn.k_norm.weight": T(t[p + "attention.key_layernorm.weight"]),
               p + "input_layernorm.weight": T(t[p + "input_layernorm.weight"]),
               p + "post_attention_layernorm.weight": T(t[p + "post_attention_layernorm.weight"])}
        if i < c.first_k_dense_replace:
            sd |= {p + f"mlp.{n}_proj.weight": T(t[p + f"mlp.{n}_proj.weight"]) for n in ("gate", "up", "down")}
            continue
        E = c.num_experts
        sd |= {p + "mlp.gate.weight": T(t[p + "mlp.gate.weight"]),
               p + "mlp.gate.e_score_correction_bias": T(t[p + "mlp.gate.expert_bias"]),
               p + "mlp.experts.gate_up_proj": T(np.stack([np.concatenate([t[p + f"mlp.experts.{e}.gate_proj.weight"],
                                                                           t[p + f"mlp.experts.{e}.up_proj.weight"]])
                                                           for e in range(E)])),
               p + "mlp.experts.down_proj": T(np.stack([t[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(E)]))}
        sd |= {p + f"mlp.shared_experts.{n}_proj.weight": T(t[p + f"mlp.shared_experts.{n}_proj.weight"])
               for n in ("gate", "up", "down")}
    result = model.load_state_dict(sd, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model


def test_network_equals_transformers_glm4_moe_under_the_same_mask(net, tensors):
    glm = glm4_moe_from_llada2(tiny_config(), tensors)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, MASK, (3, 13))
    mask = np.ones(ids.shape, bool)
    mask[1, :2] = False
    mask[2, :5] = False
    allowed, pos = L2.block_causal_mask(mask, BLOCK)
    ours = net(ids, allowed, pos)
    additive = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
    with torch.no_grad():
        ref = glm(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(additive),
                  position_ids=torch.from_numpy(pos)).logits.numpy()
    np.testing.assert_allclose(ours[mask], ref[mask], rtol=0, atol=5e-5)
    assert np.abs(ref).max() > 1.0  # not a degenerate near-zero output


def test_mask_is_block_causal_and_left_padding_matches_alone(net):
    ids = np.random.default_rng(5).integers(0, MASK, (1, 10))
    alone = L2.block_causal_logits(net, ids, np.ones(ids.shape, bool), BLOCK)
    later = ids.copy()
    later[0, 8:] = (later[0, 8:] + 5) % MASK  # block 2 changes
    got = L2.block_causal_logits(net, later, np.ones(ids.shape, bool), BLOCK)
    np.testing.assert_allclose(got[0, :8], alone[0, :8], rtol=0, atol=1e-6)
    assert not np.allclose(got[0, 8:], alone[0, 8:], atol=1e-3)
    inside = ids.copy()
    inside[0, 3] = (inside[0, 3] + 5) % MASK  # block 0's last token: every position of block 0 sees it
    got = L2.block_causal_logits(net, inside, np.ones(ids.shape, bool), BLOCK)
    assert not np.allclose(got[0, 0], alone[0, 0], atol=1e-4)
    for pad in (1, 3):
        row = np.concatenate([np.full((1, pad), 7), ids], axis=1)
        mask = np.concatenate([np.zeros((1, pad), bool), np.ones(ids.shape, bool)], axis=1)
        np.testing.assert_allclose(L2.block_causal_logits(net, row, mask, BLOCK)[0, pad:], alone[0], rtol=0,
                                   atol=2e-5)


def test_block_causal_mask_grid():
    allowed, pos = L2.block_causal_mask(np.array([[False, True, True, True, True, True]]), 2)
    assert pos.tolist() == [[0, 0, 1, 2, 3, 4]]
    assert allowed[0, 2].tolist() == [False, True, True, False, False, False]
    assert allowed[0, 3].tolist() == [False, True, True, True, True, False]
    assert allowed[0, 0].tolist() == [True, False, False, False, False, False]


@pytest.mark.parametrize("over, match", [({"use_bias": None}, "use_bias"), ({"use_qkv_bias": True}, "use_qkv_bias"),
                                         ({"tie_word_embeddings": True}, "untied"),
                                         ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling"),
                                         ({"num_experts": 6}, "n_group"), ({"model_type": "llama"}, "LLaDA2")])
def test_refuses_what_it_cannot_run(over, match):
    cfg = tiny_config(**over)
    if over.get("use_bias", 0) is None:
        del cfg["use_bias"]  # LLaDA2MoeConfig's default is a bias on `dense`
    with pytest.raises(ValueError, match=match):
        L2.llada2_config(cfg)


def test_unknown_tensors_are_refused(tensors):
    with pytest.raises(ValueError, match="does not read"):
        L2.LLaDA2Network(tiny_config(), tensors | {"model.layers.0.attention.dense.bias": np.zeros(32, np.float32)})


# ---------------------------------------------------------------------------- generate on hand-made logits


def _row(token: int, conf: float) -> np.ndarray:
    """Logits whose softmax puts `conf` on `token` and spreads the rest evenly (conf=1.0: every other id -inf)."""
    if conf >= 1.0:
        out = np.full(V, -np.inf)
        out[token] = 0.0
        return out
    out = np.full(V, np.log((1 - conf) / (V - 1)))
    out[token] = np.log(conf)
    return out


def _table(plan):
    """logits_fn whose row j is _row(*plan(j, ids, call)); counts its calls."""
    def fn(ids):
        out = np.stack([_row(*plan(j, ids[0], fn.calls)) for j in range(ids.shape[1])])[None]
        fn.calls += 1
        return out

    fn.calls = 0
    return fn


# Prompt [1, 2, 3], block 4: block 0 = prompt + position 3, block 1 = positions 4..7 (G = 5 -> ceil(8 / 4) = 2 blocks).
PLAN = {3: (5, 0.5), 4: (6, 0.99), 5: (7, 0.97), 6: (8, 0.6), 7: (9, 0.3)}


def _plan(j, ids, call):
    return PLAN.get(j, (0, 0.9))


def test_generate_dynamic_rule_by_hand():
    fn = _table(_plan)
    out = L2.generate(fn, [1, 2, 3], gen_length=5, block_length=4, steps=4, threshold=0.95, mask_id=MASK, eos_id=EOS)
    # block 0, step 0: quota 1 (4 // 4); the one mask (0.5) is not > 0.95, so the quota's most confident: position 3.
    # block 1, step 0: 0.99 and 0.97 pass (2 >= quota 1): both commit; step 1: none passes: top-1 = 6 (0.6);
    # step 2: 7.  Forwards: 1 + 3.
    assert out.tokens.tolist() == [1, 2, 3, 5, 6, 7, 8, 9]
    assert out.output.tolist() == [5, 6, 7, 8, 9]
    assert out.forwards == fn.calls == 4 and out.passes_per_block == [1, 3] and out.stopped is None


def test_generate_steps_and_minimal_topk():
    # steps=2: quota [2, 2]. block 0: min(2, 1 mask) -> 3. block 1 step 0: 2 pass (>= 2): 4, 5; step 1: 6, 7.
    out = L2.generate(_table(_plan), [1, 2, 3], gen_length=5, block_length=4, steps=2, mask_id=MASK, eos_id=EOS)
    assert out.passes_per_block == [1, 2] and out.tokens.tolist() == [1, 2, 3, 5, 6, 7, 8, 9]
    # minimal_topk=3: steps = min(4, 5 // 3) = 1, quota [4]: 2 passing < 4 -> the top min(4, 4): the whole block.
    out = L2.generate(_table(_plan), [1, 2, 3], gen_length=5, block_length=4, steps=4, minimal_topk=3,
                      mask_id=MASK, eos_id=EOS)
    assert out.passes_per_block == [1, 1] and out.forwards == 2


def test_generate_threshold_is_strict():
    # Confidence exactly 1.0 (every other logit -inf) at positions 4 and 5, threshold 1.0: neither is "> 1.0", so
    # every step of block 1 falls back to the quota (1): one commit per step, 4 steps for its 4 masks.
    plan = {**PLAN, 4: (6, 1.0), 5: (7, 1.0)}
    out = L2.generate(_table(lambda j, ids, c: plan.get(j, (0, 0.9))), [1, 2, 3], gen_length=5, block_length=4,
                      steps=4, threshold=1.0, mask_id=MASK, eos_id=EOS)
    assert out.passes_per_block == [1, 4]  # one commit per step in block 1
    out = L2.generate(_table(lambda j, ids, c: plan.get(j, (0, 0.9))), [1, 2, 3], gen_length=5, block_length=4,
                      steps=4, threshold=0.999, mask_id=MASK, eos_id=EOS)
    assert out.passes_per_block == [1, 3]  # now both pass together


def test_generate_stops_after_the_block_holding_eos():
    # G = 9: three blocks (ceil(12 / 4)). Position 5 predicts eos: block 1 is finished, then the loop stops.
    plan = {**PLAN, 5: (EOS, 0.97)}
    fn = _table(lambda j, ids, c: plan.get(j, (0, 0.9)))
    out = L2.generate(fn, [1, 2, 3], gen_length=9, block_length=4, steps=4, mask_id=MASK, eos_id=EOS)
    assert out.stopped == "eos" and out.blocks == 2 and out.forwards == 4
    assert out.output.tolist() == [5, 6, EOS]  # the answer, cut after the first eos
    assert (out.tokens[8:] == MASK).all()  # block 2 never decoded
    # Their in-block early stop: eos commits on block 1's first step with everything before it decoded -> stop now.
    fn = _table(lambda j, ids, c: plan.get(j, (0, 0.9)))
    out = L2.generate(fn, [1, 2, 3], gen_length=9, block_length=4, steps=4, mask_id=MASK, eos_id=EOS,
                      eos_early_stop=True)
    assert out.stopped == "eos_early_stop" and out.forwards == 2 and out.output.tolist() == [5, 6, EOS]
    assert (out.tokens[6:8] == MASK).all()


def test_generate_terminates_when_the_mask_is_predicted():
    # Position 7 predicts the mask id itself, confidently: each step "commits" it and nothing changes there.
    # Their loop runs at most `steps` steps per block and moves on, the mask left in place.
    plan = {**PLAN, 7: (MASK, 0.99)}
    fn = _table(lambda j, ids, c: plan.get(j, (0, 0.9)))
    out = L2.generate(fn, [1, 2, 3], gen_length=9, block_length=4, steps=4, mask_id=MASK, eos_id=EOS)
    # Block 1: 4, 5 pass on step 0 (7's 0.99 too, writing the mask back), 6 on step 1, then 7 again and again until
    # the 4 steps are spent. Block 2 (0.9 everywhere: below 0.95) takes one commit per step.
    assert out.passes_per_block == [1, 4, 4] and out.tokens[7] == MASK and out.tokens[8:].tolist() == [0] * 4
    # never_predict=(MASK,): the mask's runner-up (uniform rest, lowest id: 0) is taken instead.
    out = L2.generate(_table(lambda j, ids, c: plan.get(j, (0, 0.9))), [1, 2, 3], gen_length=9, block_length=4,
                      steps=4, mask_id=MASK, eos_id=EOS, never_predict=(MASK,))
    assert not (out.tokens == MASK).any() and out.tokens[7] == 0


def test_generate_on_the_tiny_network(net):
    fn = L2.llada2_logits_fn(net, BLOCK)
    seen = []

    def no_mask(ids):
        seen.append(ids.shape[1])
        return fn(ids)

    prompt = np.random.default_rng(2).integers(0, EOS, 6)  # P = 6: block 1 holds the prompt's last 2 tokens
    out = L2.generate(no_mask, prompt, gen_length=8, block_length=BLOCK, steps=4, threshold=0.5, mask_id=MASK,
                      eos_id=EOS, never_predict=(MASK, EOS))
    assert out.blocks == 3 and out.tokens.shape == (16,) and not (out.tokens == MASK).any()
    np.testing.assert_array_equal(out.tokens[:6], prompt)
    assert out.forwards == sum(out.passes_per_block) == len(seen) and out.forwards <= 3 * 4
    assert set(seen) == {8, 12, 16}  # each pass recomputes [0, block end)
