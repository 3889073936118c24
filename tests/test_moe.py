"""The MoE layer (localleap_jax/moe.py) against independent references: transformers' own routers and MoE blocks
(DeepSeek-V3 and GLM-4.5's group-limited sigmoid router with a shared expert, Qwen3-MoE's and OLMoE's softmax
top-k, DiffusionGemma's router with per-expert scales and GELU-tanh experts), an eager numpy transcription of
LLaDA-MoE's gate (../shared/reference/llada2-moe.md), the all-experts einsum, and one device against meshes with
an expert axis (8 fake CPU devices, in a subprocess); which leaves `partition` splits over that axis.

Choices and weights are checked apart: a token's experts as a set, the weights matched by expert id. Each test
asserts its case happened (several experts chosen, the bias and the groups changing some choice), since zeros
or a single group hide a selection/weight mix-up."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import REPO
from localleap_jax.errors import ConfigError
from localleap_jax.moe import MoE, Router, dense_mlp, moe_layer, route, routed_all, routed_sparse

D, F = 32, 16  # hidden size, expert width


def _normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _params(rng, E, shared=0, bias_scale=0.0, expert_scale=False):
    """A layer's parameters in moe.py's layout (fp32 numpy)."""
    p = {"gate": {"kernel": _normal(rng, (D, E), 0.5)},
         "experts": {"gate_proj": _normal(rng, (E, D, F), 0.3), "up_proj": _normal(rng, (E, D, F), 0.3),
                     "down_proj": _normal(rng, (E, F, D), 0.3)}}
    if bias_scale:
        p["expert_bias"] = _normal(rng, (E,), bias_scale)
    if expert_scale:
        p["expert_scale"] = (1.0 + _normal(rng, (E,), 0.5)).astype(np.float32)
    if shared:
        p["shared"] = {"gate_proj": {"kernel": _normal(rng, (D, shared), 0.3)},
                       "up_proj": {"kernel": _normal(rng, (D, shared), 0.3)},
                       "down_proj": {"kernel": _normal(rng, (shared, D), 0.3)}}
    return p


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def _route(router, h, p):
    idx, w = route(router, jnp.asarray(h), p["gate"]["kernel"], p.get("expert_bias"), p.get("expert_scale"))
    return np.asarray(idx), np.asarray(w)


def _by_expert(idx, w):
    """Each token's (expert, weight) pairs sorted by expert: compares choices as sets and weights by expert."""
    order = np.argsort(idx, axis=-1)
    return np.take_along_axis(idx, order, -1), np.take_along_axis(w, order, -1)


def assert_same_routing(ours, theirs, atol=1e-6):
    (i1, w1), (i2, w2) = _by_expert(*ours), _by_expert(*theirs)
    np.testing.assert_array_equal(i1, i2)  # the same expert set for every token
    np.testing.assert_allclose(w1, w2, rtol=1e-5, atol=atol)  # each expert's weight


def _sets(idx):
    return [frozenset(row) for row in np.asarray(idx).tolist()]


def _changed(a, b):
    """Tokens whose expert set differs between two routings."""
    return sum(x != y for x, y in zip(_sets(a), _sets(b)))


# ---------------------------------------------------------------- routers against transformers


def _deepseek_v3_config(E, k, n_group, topk_group, norm, scale, shared=1):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=k,
                            n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                            routed_scaling_factor=scale, n_shared_experts=shared)


def _torch_gate(gate, p):
    with torch.no_grad():
        gate.weight.copy_(_t(p["gate"]["kernel"].T))
        gate.e_score_correction_bias.copy_(_t(p["expert_bias"]))


@pytest.mark.parametrize("E, k, n_group, topk_group, norm, scale", [
    (32, 4, 4, 2, True, 2.5),   # LLaDA2's shape of router: groups, renormalised, scaled
    (32, 6, 8, 3, False, 0.7),  # not renormalised, scale < 1
    (16, 2, 1, 1, True, 1.8),   # one group (no group limit)
])
def test_sigmoid_group_router_matches_deepseek_v3(E, k, n_group, topk_group, norm, scale):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    rng = np.random.default_rng(E + k)
    p = _params(rng, E, bias_scale=0.15)
    h = _normal(rng, (96, D))
    gate = DeepseekV3TopkRouter(_deepseek_v3_config(E, k, n_group, topk_group, norm, scale)).eval()
    _torch_gate(gate, p)
    with torch.no_grad():
        _, w, i = gate(_t(h))
    router = Router(E, k, score="sigmoid", bias="select", n_group=n_group, topk_group=topk_group, normalise=norm,
                    scale=scale)
    ours = _route(router, h, p)
    assert_same_routing(ours, (i.numpy(), w.numpy()))
    # The case happened: many experts in use, the bias moved choices, the group limit moved choices.
    assert len(np.unique(ours[0])) > k
    assert _changed(ours[0], _route(router, h, {**p, "expert_bias": 0 * p["expert_bias"]})[0]) > 0
    if n_group > 1:
        assert _changed(ours[0], _route(Router(E, k, score="sigmoid", bias="select"), h, p)[0]) > 0
    sums = ours[1].sum(-1)
    assert np.allclose(sums, scale, rtol=1e-5) if norm else not np.allclose(sums, scale, rtol=1e-2)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_router_matches_qwen3_moe_and_olmoe(family, norm):
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Gate
    else:
        from transformers import OlmoeConfig as Config
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter as Gate
    E, k = 16, 4
    rng = np.random.default_rng(7)
    p = _params(rng, E)
    h = _normal(rng, (80, D))
    gate = Gate(Config(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=k,
                       norm_topk_prob=norm)).eval()
    with torch.no_grad():
        gate.weight.copy_(_t(p["gate"]["kernel"].T))
        _, w, i = gate(_t(h))
    ours = _route(Router(E, k, score="softmax", normalise=norm), h, p)
    assert_same_routing(ours, (i.numpy(), w.numpy()))
    assert len(np.unique(ours[0])) > k
    assert np.allclose(ours[1].sum(-1), 1.0, rtol=1e-5) == norm  # renormalised exactly when asked


def test_gemma_router_and_gelu_tanh_experts_match_diffusion_gemma():
    """DiffusionGemma: softmax top-k renormalised, times a learned per-expert scale, on an RMS-normalised and
    scaled router input (computed by the caller: `route` takes it as h); GELU-tanh experts."""
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as gemma
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    E, k = 16, 4
    rng = np.random.default_rng(3)
    p = _params(rng, E, expert_scale=True)
    h = _normal(rng, (64, D))
    config = DiffusionGemmaTextConfig(hidden_size=D, num_experts=E, top_k_experts=k, moe_intermediate_size=F,
                                      hidden_activation="gelu_pytorch_tanh")
    router, experts = gemma.DiffusionGemmaTextRouter(config).eval(), gemma.DiffusionGemmaTextExperts(config).eval()
    input_scale = 1.0 + _normal(rng, (D,), 0.3)
    with torch.no_grad():
        router.proj.weight.copy_(_t(p["gate"]["kernel"].T))
        router.scale.copy_(_t(input_scale))
        router.per_expert_scale.copy_(_t(p["expert_scale"]))
        experts.gate_up_proj.copy_(_t(np.concatenate([p["experts"]["gate_proj"], p["experts"]["up_proj"]], -1)
                                      .transpose(0, 2, 1)))
        experts.down_proj.copy_(_t(p["experts"]["down_proj"].transpose(0, 2, 1)))
        _, w, i = router(_t(h))
        y_torch = experts(_t(h), i, w).numpy()
    # The router's input, as the model computes it (numpy transcription of its norm-then-scale).
    router_input = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + config.rms_norm_eps) * input_scale * D ** -0.5
    ours = _route(Router(E, k, score="softmax", normalise=True, expert_scale=True), router_input, p)
    assert_same_routing(ours, (i.numpy(), w.numpy()))
    assert not np.allclose(ours[1].sum(-1), 1.0, rtol=1e-2)  # the per-expert scales took part
    for dispatch in ("capacity", "ragged", "tiles"):
        y = routed_sparse(MoE(Router(E, k), activation="gelu_tanh", dispatch=dispatch), p["experts"],
                          jnp.asarray(h), jnp.asarray(ours[0]), jnp.asarray(ours[1]))
        np.testing.assert_allclose(np.asarray(y), y_torch, rtol=1e-5, atol=1e-5)
    silu = routed_sparse(MoE(Router(E, k)), p["experts"], jnp.asarray(h), jnp.asarray(ours[0]), jnp.asarray(ours[1]))
    assert not np.allclose(np.asarray(silu), y_torch, atol=1e-3)  # the activation matters here


# ---------------------------------------------------------------- LLaDA-MoE: numpy transcription


def llada_moe_numpy(p, h, k):
    """LLaDA-MoE's gate and block, eagerly (the reference's 'Router' of LLaDA-MoE-7B-A1B): fp32 softmax of the
    logits, the expert bias ADDED to the probabilities, top-k of those, and the biased values are the weights
    (never renormalised, no scaling); each chosen expert's SwiGLU times its weight, summed; plus the shared
    expert. Returns (expert ids [T, k], weights [T, k], output [T, D])."""
    logits = h.astype(np.float64) @ p["gate"]["kernel"].astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    probs = probs + p["expert_bias"]
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, idx, -1)
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    out = np.zeros_like(h, dtype=np.float64)
    ex = p["experts"]
    for t in range(h.shape[0]):
        for j in range(k):
            e = idx[t, j]
            hidden = silu(h[t] @ ex["gate_proj"][e]) * (h[t] @ ex["up_proj"][e])
            out[t] += weights[t, j] * (hidden @ ex["down_proj"][e])
    s = p["shared"]
    out += (silu(h @ s["gate_proj"]["kernel"]) * (h @ s["up_proj"]["kernel"])) @ s["down_proj"]["kernel"]
    return idx, weights, out


@pytest.mark.parametrize("dispatch", ["capacity", "ragged", "tiles", "all"])
def test_llada_moe_router_and_block_match_numpy_transcription(dispatch):
    E, k = 16, 4
    rng = np.random.default_rng(11)
    p = _params(rng, E, shared=2 * F, bias_scale=0.05)
    h = _normal(rng, (48, D))
    idx, weights, y_ref = llada_moe_numpy(p, h, k)
    router = Router(E, k, score="softmax", bias="weights")
    ours = _route(router, h, p)
    assert_same_routing(ours, (idx, weights))
    # The case happened: the bias moved choices, and the weights are the biased values (unbiased ones differ).
    assert _changed(ours[0], _route(router, h, {**p, "expert_bias": 0 * p["expert_bias"]})[0]) > 0
    select_only = _route(Router(E, k, score="softmax", bias="select"), h, p)
    assert not np.allclose(_by_expert(*ours)[1], _by_expert(*select_only)[1], atol=1e-3)
    y = moe_layer(MoE(router, dispatch=dispatch), p, jnp.asarray(h))
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- whole block against transformers


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("dispatch", ["capacity", "ragged", "tiles", "all"])
def test_moe_block_matches_transformers(family, dispatch):
    """Routed (group-limited sigmoid, bias, renormalised, scaled) plus one shared expert, against
    DeepseekV3MoE / Glm4MoeMoE with the weights mapped."""
    E, k, n_group, topk_group, scale = 32, 4, 4, 2, 2.5
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
        config = _deepseek_v3_config(E, k, n_group, topk_group, True, scale)
    else:
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE as Block
        config = Glm4MoeConfig(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=k,
                               n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                               routed_scaling_factor=scale, n_shared_experts=1)
    rng = np.random.default_rng(5)
    p = _params(rng, E, shared=F, bias_scale=0.15)
    h = _normal(rng, (2, 24, D))
    block = Block(config).eval()
    _torch_gate(block.gate, p)
    with torch.no_grad():
        ex = p["experts"]
        block.experts.gate_up_proj.copy_(_t(np.concatenate([ex["gate_proj"], ex["up_proj"]], -1).transpose(0, 2, 1)))
        block.experts.down_proj.copy_(_t(ex["down_proj"].transpose(0, 2, 1)))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(block.shared_experts, name).weight.copy_(_t(p["shared"][name]["kernel"].T))
        y_torch = block(_t(h)).numpy()
    router = Router(E, k, score="sigmoid", bias="select", n_group=n_group, topk_group=topk_group, normalise=True,
                    scale=scale)
    y = moe_layer(MoE(router, dispatch=dispatch), p, jnp.asarray(h))
    assert y.shape == h.shape
    np.testing.assert_allclose(np.asarray(y), y_torch, rtol=1e-5, atol=2e-5)
    shared_only = np.asarray(dense_mlp("silu", p["shared"], jnp.asarray(h.reshape(-1, D)))).reshape(h.shape)
    assert np.abs(y_torch - shared_only).max() > 0.1  # the routed part is not negligible


# ---------------------------------------------------------------- the implementations against each other


def _layer_case(E=32, k=4, T=200, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    p = jax.tree.map(lambda a: jnp.asarray(a, dtype), _params(rng, E, shared=F, bias_scale=0.1))
    x = jnp.asarray(_normal(rng, (T, D)), dtype)
    router = Router(E, k, score="sigmoid", bias="select", n_group=4, topk_group=2, normalise=True, scale=2.5)
    return router, p, x


def test_sparse_dispatch_equals_all_experts():
    """The grouped matmuls against every-expert-on-every-token, in fp32, at several tile sizes (the tile bound's
    padding and its empty experts included) and capacities (small ones overflow into tiles). The only difference is the order of fp32 sums: measured
    max |diff| 9.5e-7 (ragged, tiles of 1) to 4.8e-6 (tiles of 64) on outputs of max |y| 16, i.e. <= 3.0e-7
    of max |y|; the bound is 1e-6 of it."""
    router, p, x = _layer_case()
    idx, w = route(router, x, p["gate"]["kernel"], p["expert_bias"])
    assert len(np.unique(np.asarray(idx))) > router.num_experts * 3 // 4  # most experts have rows
    reference = routed_all("silu", p["experts"], x, idx, w)
    scale = float(jnp.max(jnp.abs(reference)))
    assert scale > 1.0
    sizes = np.bincount(np.asarray(idx).reshape(-1), minlength=router.num_experts)
    assert sizes.min() <= 3 < sizes.max() and sizes.max() > 2 * sizes.mean()  # capacities 3 and 8 overflow
    moes = ([MoE(router, dispatch="ragged")] + [MoE(router, dispatch="tiles", tile=t) for t in (None, 1, 7, 64)]
            + [MoE(router, capacity=c, tile=t) for c, t in ((None, None), (3, None), (8, 4), (200, None))])
    for moe in moes:
        y = jax.jit(lambda p, x, moe=moe: routed_sparse(moe, p["experts"], x, idx, w))(p, x)
        err = float(jnp.max(jnp.abs(y - reference)))
        assert err <= 1e-6 * scale, (moe.dispatch, moe.capacity, moe.tile, err)
    # Few tokens and many experts: most experts have no row (the tiles' static bound is mostly padding).
    small = x[:3]
    idx, w = route(router, small, p["gate"]["kernel"], p["expert_bias"])
    reference = routed_all("silu", p["experts"], small, idx, w)
    for dispatch in ("capacity", "ragged", "tiles", "gmm"):  # gmm: TPU's kernel, in Pallas's interpreter here
        y = routed_sparse(MoE(router, dispatch=dispatch), p["experts"], small, idx, w)
        np.testing.assert_allclose(np.asarray(y), np.asarray(reference), rtol=1e-6, atol=1e-6 * scale)


def test_router_computes_in_fp32_under_bf16_parameters():
    """bf16 activations and parameters route exactly as their fp32 values do (the router upcasts, at full
    matmul precision); a bf16-arithmetic router would choose differently for some tokens."""
    router, p, x = _layer_case(T=512, dtype=jnp.bfloat16)
    idx, w = route(router, x, p["gate"]["kernel"], p["expert_bias"])
    assert w.dtype == jnp.float32
    idx32, w32 = route(router, x.astype(jnp.float32), p["gate"]["kernel"].astype(jnp.float32),
                       p["expert_bias"].astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx32))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w32))
    # The case happened: routing with bf16 logits picks other experts somewhere.
    logits16 = (x @ p["gate"]["kernel"]).astype(jnp.float32)  # bf16 matmul, bf16 result
    scores = jax.nn.sigmoid(logits16) + p["expert_bias"].astype(jnp.float32)
    assert _changed(np.asarray(jax.lax.top_k(scores, router.top_k)[1]),
                    np.asarray(route(Router(router.num_experts, router.top_k, score="sigmoid", bias="select"),
                                     x, p["gate"]["kernel"], p["expert_bias"])[0])) > 0
    y = moe_layer(MoE(router), p, x)
    assert y.dtype == jnp.bfloat16


def test_layer_runs_inside_while_loop_and_keeps_leading_dims():
    router, p, x = _layer_case(T=64)
    moe = MoE(router, capacity=2)  # experts overflow: the lax.cond's spill branch runs inside the loop
    idx, _ = route(router, x, p["gate"]["kernel"], p["expert_bias"])
    assert np.bincount(np.asarray(idx).reshape(-1)).max() > 2
    once = moe_layer(moe, p, x)

    @jax.jit
    def twice(p, x):
        return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, moe_layer(moe, p, c[1])), (0, x))[1]

    np.testing.assert_allclose(np.asarray(twice(p, x)), np.asarray(moe_layer(moe, p, once)), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(moe_layer(moe, p, x.reshape(4, 16, D))).reshape(64, D),
                                  np.asarray(once))


@pytest.mark.parametrize("settings, message", [
    (dict(num_experts=8, top_k=9), "top_k=9 with 8 experts"),
    (dict(num_experts=8, top_k=2, n_group=3), "n_group=3 does not divide 8 experts"),
    (dict(num_experts=8, top_k=2, n_group=4, topk_group=5), "topk_group=5"),
    (dict(num_experts=8, top_k=5, n_group=4, topk_group=2), "top_k=5 exceeds the 2 x 2 experts"),
    (dict(num_experts=8, top_k=2, score="relu"), "router score 'relu'"),
    (dict(num_experts=8, top_k=2, bias="both"), "router bias 'both'"),
])
def test_router_settings_that_cannot_run_are_named(settings, message):
    with pytest.raises(ConfigError, match=message):
        Router(**settings)


def test_parameters_that_disagree_with_the_router_are_named():
    router, p, x = _layer_case(T=4)
    with pytest.raises(ConfigError, match="expert_bias is absent"):
        route(router, x, p["gate"]["kernel"])
    with pytest.raises(ConfigError, match="does not end in num_experts=16"):
        route(Router(16, 2, bias="select"), x, p["gate"]["kernel"], p["expert_bias"])
    with pytest.raises(ConfigError, match="MoE dispatch 'sorted'"):
        MoE(router, dispatch="sorted")
    with pytest.raises(ConfigError, match="MoE capacity=0"):
        MoE(router, capacity=0)
    with pytest.raises(ConfigError, match="'all' runs every expert on one device"):
        half = {**p, "experts": jax.tree.map(lambda a: a[:16], p["experts"])}
        moe_layer(MoE(router, dispatch="all"), half, x)


# ---------------------------------------------------------------- expert parallelism on 8 fake devices

EXPERT_PARALLEL = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from localleap_jax.moe import MoE, Router, moe_layer
from localleap_jax.partition import make_mesh, param_shardings

rng = np.random.default_rng(0)
E, D, F, k, T = 32, 32, 16, 4, 96
n = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)
p = {"gate": {"kernel": n(D, E) * 2}, "expert_bias": n(E) * 0.3,
     "experts": {"gate_proj": n(E, D, F), "up_proj": n(E, D, F), "down_proj": n(E, F, D)},
     "shared": {"gate_proj": {"kernel": n(D, F)}, "up_proj": {"kernel": n(D, F)}, "down_proj": {"kernel": n(F, D)}}}
x = n(8, T // 8, D) * 3
router = Router(E, k, score="sigmoid", bias="select", n_group=4, topk_group=2, normalise=True, scale=2.5)
one = np.asarray(moe_layer(MoE(router, dispatch="all"), p, x))
expert_bytes = sum(a.nbytes for a in jax.tree.leaves(p["experts"]))
for data, expert, model in ((1, 8, 1), (2, 4, 1), (2, 2, 2), (4, 1, 2)):
    mesh = make_mesh(data, model, expert=expert)
    params = jax.tree.map(jax.device_put, p, param_shardings(p, mesh))
    held = {}
    for leaf in jax.tree.leaves(params["experts"]):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert len(held) == 8 and set(held.values()) == {expert_bytes // expert}, (data, expert, model, held)
    rows = jax.device_put(x, NamedSharding(mesh, P("data")))
    for moe in (MoE(router), MoE(router, capacity=3), MoE(router, dispatch="ragged"), MoE(router, dispatch="tiles")):
        dispatch = f"{moe.dispatch} {moe.capacity}"
        # As a plain jitted program (XLA partitions the rest) ...
        y = jax.jit(lambda p, x: moe_layer(moe, p, x, mesh=mesh))(params, rows)
        # ... and nested in a data-parallel shard_map, as dist's decode loop runs the model.
        inner = lambda p, x: moe_layer(moe, p, x, mesh=jax.sharding.get_abstract_mesh())
        nested = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"),
                                       axis_names={"data"}, check_vma=False))(params, rows)
        for got in (y, nested):
            err = float(np.max(np.abs(np.asarray(got) - one)))
            print(data, expert, model, dispatch, err)
            assert err <= 1e-6 * np.abs(one).max(), err  # measured: <= 2.7e-7 of max |y| (fp32 sum order)
# The meshes make_mesh and mesh_from_text build: (data, model) as before unless an expert axis is asked for.
from localleap_jax.partition import mesh_from_text
assert make_mesh(2, 4).axis_names == ("data", "model") and dict(make_mesh(2, 4).shape) == {"data": 2, "model": 4}
assert dict(make_mesh(expert=4).shape) == {"data": 2, "expert": 4, "model": 1}
assert dict(mesh_from_text("data=2,expert=2").shape) == {"data": 2, "expert": 2, "model": 2}
assert dict(mesh_from_text("expert=8").shape) == {"data": 1, "expert": 8, "model": 1}
assert dict(mesh_from_text("model=4").shape) == {"data": 2, "model": 4}
assert make_mesh(2, 2, expert=2).devices.flatten().tolist() == make_mesh(2, 4).devices.flatten().tolist()
print("ok", np.abs(one).max())
"""


def test_expert_parallel_meshes_equal_one_device():
    """Meshes data x expert x model of 1x8x1, 2x4x1, 2x2x2 (and 4x1x2, no expert axis) give the one-device
    all-experts output, each device holding 1/expert of the routed experts' bytes, both as a plain jitted
    program and nested in a data-parallel shard_map."""
    flags = f"--xla_force_host_platform_device_count=8 {os.environ.get('XLA_FLAGS', '')}".strip()
    r = subprocess.run([sys.executable, "-c", EXPERT_PARALLEL], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.split("\n")
    assert lines[-2].startswith("ok") and len(lines) == 4 * 4 * 2 + 2, r.stdout


def test_routed_expert_leaves_split_over_the_expert_axis():
    from jax.sharding import PartitionSpec as P

    from localleap_jax.partition import spec_for

    stacked = ("blocks", "moe", "experts", "gate_proj")
    assert spec_for(stacked, (3, 16, 32, 8), model_size=2, expert_size=4) == P(None, "expert", None, None)
    assert spec_for(("experts", "down_proj"), (16, 8, 32), model_size=2, expert_size=4) == P("expert", None, None)
    assert spec_for(stacked, (3, 16, 32, 8), model_size=2, expert_size=3) == P()  # 16 experts do not split in 3
    assert spec_for(stacked, (3, 16, 32, 8), model_size=2) == P()  # no expert axis: whole on every device
    assert spec_for(("blocks", "moe", "gate", "kernel"), (3, 32, 16), model_size=2, expert_size=4) == P()
    assert spec_for(("blocks", "q_proj", "kernel"), (3, 32, 32), model_size=2, expert_size=4) == P(None, None, "model")


@pytest.mark.parametrize("text, message", [
    ("expert=3", "expert=3 does not divide the 8 devices"),
    ("data=2,expert=2,model=1", "data x expert x model = 4 devices, but there are 8"),
    ("experts=2", "expected data=D,model=M"),
])
def test_expert_mesh_mistakes_are_named(text, message):
    from localleap_jax.errors import DecodeError
    from localleap_jax.partition import mesh_from_text

    with pytest.raises(DecodeError, match=message):
        mesh_from_text(text, devices=[object()] * 8)  # refused before any device is touched
