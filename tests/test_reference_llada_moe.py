"""The LLaDA-MoE oracle (oracles/llada_moe.py) checked on its own: without expert bias and shared expert it is
transformers' Qwen3MoeForCausalLM (per-head q/k norm, softmax top-k router without renormalisation, dense layers
by index) under a bidirectional mask; the biased router and the shared expert are checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oracles import llada_moe as LM

V, MASK = 40, 39


def tiny_config(**over) -> dict:
    cfg = {"model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "vocab_size": V, "hidden_size": 32,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
           "rope_theta": 50000.0, "partial_rotary_factor": 1.0, "dense_intermediate_size": 48,
           "expert_intermediate_size": 8, "shared_expert_intermediate_size": None, "num_experts": 8,
           "num_experts_per_tok": 3, "moe_layer_freq": [0, 1, 1], "qk_layernorm": True,
           "moe_router_enable_expert_bias": False, "norm_topk_prob": False, "routed_scaling_factor": 1,
           "attention_bias": False, "clip_qkv": None, "tie_word_embeddings": False, "rope_scaling": None}
    cfg.update(over)
    return cfg


def tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = LM.llada_moe_config(cfg)
    H, D = c.hidden_size, c.head_dim

    def w(*shape, s=0.25):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def mlp(prefix, F):
        return {prefix + "gate_proj.weight": w(F, H), prefix + "up_proj.weight": w(F, H),
                prefix + "down_proj.weight": w(H, F)}

    out = {"model.embed_tokens.weight": w(cfg["vocab_size"], H, s=1.0), "model.norm.weight": 1 + w(H, s=0.1), "lm_head.weight": w(cfg["vocab_size"], H)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": 1 + w(H, s=0.1), p + "post_attention_layernorm.weight": 1 + w(H, s=0.1),
                p + "self_attn.q_proj.weight": w(c.num_heads * D, H),
                p + "self_attn.k_proj.weight": w(c.num_kv_heads * D, H),
                p + "self_attn.v_proj.weight": w(c.num_kv_heads * D, H), p + "self_attn.o_proj.weight": w(H, H),
                p + "self_attn.q_norm.weight": 1 + w(D, s=0.1), p + "self_attn.k_norm.weight": 1 + w(D, s=0.1)}
        if not c.moe_layers[i]:
            out |= mlp(p + "mlp.", c.dense_intermediate_size)
            continue
        out[p + "mlp.gate.weight"] = w(c.num_experts, H, s=1.0)
        for e in range(c.num_experts):
            out |= mlp(p + f"mlp.experts.{e}.", c.expert_intermediate_size)
        if c.expert_bias:
            out[p + "mlp.expert_bias"] = np.abs(w(c.num_experts, s=0.1))
        if c.shared_expert_intermediate_size:
            out |= mlp(p + "shared_expert.", c.shared_expert_intermediate_size)
    return out


def qwen3_moe_from_llada_moe(cfg: dict, t: dict):
    """transformers' Qwen3MoeForCausalLM holding LLaDA-MoE tensors (no bias, no shared expert; experts stacked)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    c = LM.llada_moe_config(cfg)
    assert not c.expert_bias and not c.shared_expert_intermediate_size and c.rotary_dim == c.head_dim
    qc = Qwen3MoeConfig(vocab_size=V, hidden_size=c.hidden_size, intermediate_size=c.dense_intermediate_size,
                        moe_intermediate_size=c.expert_intermediate_size, num_hidden_layers=c.num_layers,
                        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                        rms_norm_eps=c.rms_norm_eps, num_experts=c.num_experts, num_experts_per_tok=c.top_k,
                        norm_topk_prob=False, decoder_sparse_step=1,
                        mlp_only_layers=[i for i, m in enumerate(c.moe_layers) if not m],
                        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                        attention_bias=False, tie_word_embeddings=False, attn_implementation="eager")
    model = Qwen3MoeForCausalLM(qc).eval()
    T = torch.from_numpy
    sd = {k: T(v) for k, v in t.items() if ".mlp.experts." not in k}
    for i in range(c.num_layers):
        if c.moe_layers[i]:
            p = f"model.layers.{i}.mlp."
            E = c.num_experts
            sd[p + "experts.gate_up_proj"] = T(np.stack([np.concatenate([t[p + f"experts.{e}.gate_proj.weight"],
                                                                          t[p + f"experts.{e}.up_proj.weight"]])
                                                          for e in range(E)]))
            sd[p + "experts.down_proj"] = T(np.stack([t[p + f"experts.{e}.down_proj.weight"] for e in range(E)]))
    result = model.load_state_dict(sd, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model


def test_network_equals_transformers_qwen3_moe_bidirectional():
    cfg = tiny_config()
    t = tiny_tensors(cfg)
    net = LM.LLaDAMoENetwork(cfg, t)
    ref_model = qwen3_moe_from_llada_moe(cfg, t)
    ids = np.random.default_rng(3).integers(0, MASK, (2, 11))
    mask = np.ones(ids.shape, bool)
    mask[1, :4] = False
    allowed, pos = LM.bidirectional_mask(mask)
    ours = net(ids, allowed, pos)
    additive = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(additive),
                        position_ids=torch.from_numpy(pos)).logits.numpy()
    np.testing.assert_allclose(ours[mask], ref[mask], rtol=0, atol=5e-5)
    # Dense layer 0 really is dense and layers 1-2 MoE (a wrong moe_layer_freq reading would not load the tensors).
    assert "mlp" in net.layers[0] and "experts" in net.layers[1] and "experts" in net.layers[2]


def test_bidirectional_and_left_padding_matches_alone():
    cfg = tiny_config()
    net = LM.LLaDAMoENetwork(cfg, tiny_tensors(cfg))
    ids = np.random.default_rng(4).integers(0, MASK, (1, 9))
    alone = LM.bidirectional_logits(net, ids, np.ones(ids.shape, bool))
    last = ids.copy()
    last[0, -1] = (last[0, -1] + 3) % MASK
    assert not np.allclose(LM.bidirectional_logits(net, last, np.ones(ids.shape, bool))[0, 0], alone[0, 0], atol=1e-4)
    for pad in (1, 4):
        row = np.concatenate([np.full((1, pad), 5), ids], axis=1)
        mask = np.concatenate([np.zeros((1, pad), bool), np.ones(ids.shape, bool)], axis=1)
        np.testing.assert_allclose(LM.bidirectional_logits(net, row, mask)[0, pad:], alone[0], rtol=0, atol=2e-5)


def test_router_adds_the_bias_to_the_weights_and_never_renormalises():
    # Two tokens, four experts, top 2. Token 0: logits ln[4, 3, 2, 1] -> probs [.4, .3, .2, .1]; bias [0, 0, .15, 0]
    # -> [.4, .3, .35, .1]: experts 0 and 2 (the bias moved 2 past 1), weights .4 and .35 (sum .75: no renorm).
    # Token 1: probs [.1, .2, .3, .4] + bias -> [.1, .2, .45, .4]: experts 2 and 3, weights .45 and .4.
    h = torch.eye(4, dtype=torch.float64)[:2]
    gate = torch.tensor(np.log([[4, 1], [3, 2], [2, 3], [1, 4]]), dtype=torch.float64)  # [E, H=2] on h[:, :2]
    bias = torch.tensor([0.0, 0.0, 0.15, 0.0], dtype=torch.float64)
    idx, w = LM.route_softmax_topk(h[:, :2], gate, bias, top_k=2)
    order = idx.argsort(-1)
    assert idx.gather(1, order).tolist() == [[0, 2], [2, 3]]
    np.testing.assert_allclose(w.gather(1, order).numpy(), [[0.4, 0.35], [0.45, 0.4]], rtol=1e-12)
    idx, w = LM.route_softmax_topk(h[:, :2], gate, None, top_k=2)  # no bias: [0, 1] at .4, .3
    assert sorted(idx[0].tolist()) == [0, 1] and w.sum(-1).tolist() == pytest.approx([0.7, 0.7])


def test_expert_bias_and_shared_expert_in_the_network():
    base_cfg = tiny_config()
    base = tiny_tensors(base_cfg)
    cfg = tiny_config(moe_router_enable_expert_bias=True, shared_expert_intermediate_size=6)
    t = tiny_tensors(cfg, seed=9)
    for k in base:  # the same weights; the biased, shared config only adds tensors
        t[k] = base[k]
    net, plain = LM.LLaDAMoENetwork(cfg, t), LM.LLaDAMoENetwork(base_cfg, base)
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((1, 5, 32)).astype(np.float32))
    p = net.layers[1]
    idx, w = net.route(1, x[0])
    # MoE layer 1 = its routed experts with the biased weights + the shared expert, by hand.
    def swiglu(v, gate, up, down):
        return (torch.nn.functional.silu(v @ gate.T) * (v @ up.T)) @ down.T

    routed = sum(w[:, k, None] * torch.stack([swiglu(x[0, j], *p["experts"][int(idx[j, k])]) for j in range(5)])
                 for k in range(net.config.top_k))
    np.testing.assert_allclose(net.mlp(1, x)[0].numpy(), (routed + swiglu(x[0], *p["shared"])).numpy(),
                               rtol=1e-5, atol=1e-6)
    # The bias changes the weights (probabilities + bias) and the shared expert adds: the two networks differ.
    plain_idx, plain_w = plain.route(1, x[0])
    assert not torch.allclose(plain_w.sum(-1), w.sum(-1))
    assert (w.sum(-1) > plain_w.sum(-1) - 1e-6).all()  # the bias is non-negative here: it only adds
    assert not np.allclose(net.mlp(1, x).numpy(), plain.mlp(1, x).numpy(), atol=1e-4)


def test_tied_head_and_refusals():
    cfg = tiny_config(tie_word_embeddings=True)
    t = tiny_tensors(cfg)
    del t["lm_head.weight"]
    net = LM.LLaDAMoENetwork(cfg, t)
    assert net.head is net.embed
    with pytest.raises(KeyError, match="lm_head"):
        LM.LLaDAMoENetwork(tiny_config(), t)
    for over, match in [({"moe_layer_freq": [0, 1]}, "moe_layer_freq"), ({"partial_rotary_factor": -1}, "rotary"),
                        ({"attention_bias": True}, "bias"), ({"architectures": ["LLaDAModelLM"]}, "LLaDA-MoE"),
                        ({"shared_expert_intermediate_size": -1}, "shared_expert")]:
        with pytest.raises(ValueError, match=match):
            LM.llada_moe_config(tiny_config(**over))
