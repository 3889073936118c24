"""LLaDA2.x and LLaDA-MoE (#36): converted from tiny random Hugging Face checkpoints (the authors' tensor names,
config.json without mask or eos ids), their logits against the eager oracles (oracles/llada2.py,
oracles/llada_moe.py: the authors' modeling transcribed in PyTorch, themselves checked against transformers'
Glm4Moe / Qwen3-MoE), left-padded rows equal alone, and LLaDA2's decoding against its authors' generate."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import localleap_jax as ll
from helpers import TOKENIZER_CORPUS, write_hf_checkpoint
from localleap_jax.families import make_tokenizer
from localleap_jax.model import forward
from localleap_jax.moe import MoELayers
from oracles import llada2 as L2
from oracles import llada_moe as LM
from test_reference_llada2 import tiny_config as llada2_config, tiny_tensors as llada2_tensors
from test_reference_llada_moe import tiny_config as llada_moe_config, tiny_tensors as llada_moe_tensors

FP32_TOL = 5e-5  # measured max |diff| 4.7e-6 on logits of scale ~6 (fp32 on both sides, different op orders)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer("llada2", TOKENIZER_CORPUS, vocab_size=300)


def _ids(tok):
    vocab = tok.get_vocab()
    return len(tok), vocab["<|mask|>"], vocab["<|endoftext|>"]


def _convert(tmp_path_factory, name, cfg, tensors, tok):
    src = write_hf_checkpoint(tmp_path_factory.mktemp(name) / "hf", cfg,
                              {k: torch.from_numpy(v) for k, v in tensors.items()}, tok)
    out = tmp_path_factory.mktemp(name) / "ck"
    from localleap_jax.convert_hf import convert
    convert(str(src), str(out), progress=False)
    return ll.load(out, dtype="float32"), out


@pytest.fixture(scope="module")
def llada2(tmp_path_factory, tokenizer):
    V, mask_id, eos_id = _ids(tokenizer)
    cfg = llada2_config(vocab_size=V)  # no mask / eos ids: the converter reads them from the tokenizer
    tensors = llada2_tensors(cfg)
    model, out = _convert(tmp_path_factory, "llada2", cfg, tensors, tokenizer)
    net = L2.LLaDA2Network({**cfg, "mask_token_id": mask_id, "eos_token_id": eos_id}, tensors)
    return model, net, out


@pytest.fixture(scope="module")
def llada_moe(tmp_path_factory, tokenizer):
    V, mask_id, eos_id = _ids(tokenizer)
    cfg = llada_moe_config(vocab_size=V, moe_router_enable_expert_bias=True, shared_expert_intermediate_size=12)
    tensors = llada_moe_tensors(cfg)
    model, out = _convert(tmp_path_factory, "llada_moe", cfg, tensors, tokenizer)
    return model, LM.LLaDAMoENetwork(cfg, tensors), out


def _batch(V, lengths, seed, avoid=()):
    rng = np.random.default_rng(seed)
    L = max(lengths)
    ids = np.zeros((len(lengths), L), np.int32)
    mask = np.zeros((len(lengths), L), bool)
    for b, n in enumerate(lengths):
        row = rng.integers(0, V, n)
        while np.isin(row, avoid).any():
            row = np.where(np.isin(row, avoid), rng.integers(0, V, n), row)
        ids[b, L - n:], mask[b, L - n:] = row, True
    return ids, mask


def test_the_converted_configs_name_their_family_ids_and_experts(llada2, llada_moe, tokenizer):
    V, mask_id, eos_id = _ids(tokenizer)
    for (model, _, out), family in ((llada2, "llada2"), (llada_moe, "llada_moe")):
        c = model.config
        assert (c.family, c.mask_token_id, c.eos_token_id, c.pad_token_id) == (family, mask_id, eos_id, eos_id)
        assert isinstance(c.arch, MoELayers) and any(c.arch.layers)
        written = json.loads((out / "config.json").read_text())
        assert written["mask_token_id"] == mask_id  # the completed config.json states it
    assert llada2[0].config.block_size == 32 and llada2[0].config.flexible_block
    assert llada2[0].config.arch.layers == (False, True, True)  # first_k_dense_replace 1
    assert llada2[0].config.rotary_dim == 8 and llada2[0].config.head_dim == 16


@pytest.mark.parametrize("block", [4, 32])
def test_llada2_logits_equal_the_eager_network_block_causal_and_left_padded(llada2, tokenizer, block):
    model, net, _ = llada2
    V, mask_id, eos_id = _ids(tokenizer)
    ids, mask = _batch(V, [11, 5, 9], seed=block, avoid=(mask_id,))
    config = dataclasses.replace(model.config, block_size=block)
    ours = np.asarray(forward(model.params, ids, mask, config))
    ref = L2.block_causal_logits(net, ids, mask, block)
    err = np.abs(ours - ref)[mask].max()
    print(f"block {block}: fp32 max |diff| = {err:.2e} (logit scale {np.abs(ref[mask]).max():.1f})")
    assert err <= FP32_TOL
    for b in range(len(ids)):  # each left-padded row equals itself alone
        alone = np.asarray(forward(model.params, ids[b][mask[b]][None], None, config))
        np.testing.assert_allclose(ours[b][mask[b]], alone[0], atol=1e-4)
    if block == 4:  # the test can fail: the same weights attending bidirectionally are far off
        wrong = np.asarray(forward(model.params, ids, mask, dataclasses.replace(config, block_size=0)))
        assert np.abs(wrong - ref)[mask].max() > 100 * FP32_TOL


def test_llada_moe_logits_equal_the_eager_network_bidirectional_and_left_padded(llada_moe, tokenizer):
    model, net, _ = llada_moe
    V, mask_id, _ = _ids(tokenizer)
    ids, mask = _batch(V, [10, 4, 7], seed=3, avoid=(mask_id,))
    ours = np.asarray(forward(model.params, ids, mask, model.config))
    allowed, positions = LM.bidirectional_mask(mask)
    ref = net(ids, allowed, positions)
    err = np.abs(ours - ref)[mask].max()
    print(f"llada_moe fp32 max |diff| = {err:.2e}")
    assert err <= FP32_TOL
    # the expert bias is used as the weights (LLaDA-MoE's trap): used for selection only, the logits move
    a = model.config.arch
    select_only = dataclasses.replace(a, moe=dataclasses.replace(a.moe, router=dataclasses.replace(
        a.moe.router, bias="select")))
    wrong = np.asarray(forward(model.params, ids, mask, dataclasses.replace(model.config, arch=select_only)))
    assert np.abs(wrong - ref)[mask].max() > 100 * FP32_TOL


def _authors(net, prompt, *, gen, block, steps, threshold, mask_id, eos_id):
    """The authors' generate (oracles/llada2.py) on one prompt; the mask id never predicted, as here."""
    return L2.generate(L2.llada2_logits_fn(net, block), prompt, gen_length=gen, block_length=block, steps=steps,
                       threshold=threshold, eos_id=eos_id, mask_id=mask_id, never_predict=(mask_id,))


def _cut(tokens, eos_id):
    eos = np.flatnonzero(tokens == eos_id)
    return tokens[: eos[0] + 1] if eos.size else tokens


@pytest.mark.parametrize("block, gen, threshold", [(4, 14, 0.03), (8, 20, 0.02)])
def test_llada2_decodes_as_its_authors_generate_with_the_exact_block_cache(llada2, tokenizer, block, gen, threshold):
    """Tokens equal the authors' generate (greedy, the dynamic rule, eos stop after a block) and NFE equals their
    forward count (their loop recomputes [0, block end) each step, ours reads the exact block cache); a left-padded
    batch equals each row alone. The grid follows the decoding block (LLaDA2's block is a setting)."""
    model, net, _ = llada2
    V, mask_id, eos_id = _ids(tokenizer)
    ids, mask = _batch(V, [7, 3, 12], seed=block, avoid=(mask_id, eos_id))
    per_block = block  # steps = block length per block, the authors' default
    rows = []
    for b in range(len(ids)):
        prompt = ids[b][mask[b]]
        ref = _authors(net, prompt, gen=gen, block=block, steps=per_block, threshold=threshold, mask_id=mask_id,
                       eos_id=eos_id)
        S = (-(-(len(prompt) + gen) // block) - len(prompt) // block) * per_block  # the S
        cfg = ll.DecodeConfig(strategy=ll.rule("dynamic", threshold=threshold, steps=S), gen_length=gen,
                              block_length=block, early_stop=True)
        alone = ll.generate(model, prompt[None], None, cfg)
        ours = np.asarray(alone.tokens[0, alone.prompt_length:])
        np.testing.assert_array_equal(_cut(ours, eos_id), ref.output)
        assert int(alone.nfe[0]) == ref.forwards
        rows.append((S, ours, int(alone.nfe[0]), ref))
    # one batch (left-padded, per-row steps) equals each row alone
    steps = np.array([S for S, *_ in rows])
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("dynamic", threshold=threshold, steps=steps),
                                                        gen_length=gen, block_length=block, early_stop=True))
    for b, (_, ours, nfe, _) in enumerate(rows):
        np.testing.assert_array_equal(np.asarray(out.tokens[b, out.prompt_length:]), ours)
        assert int(out.nfe[b]) == nfe
    # the case happened: some pass committed more than the quota (threshold), and the authors' count equals ours
    assert any(max(r.passes_per_block) < block for *_, r in rows)


class _AsTransformers:
    """The eager LLaDA-MoE network behind the call the eager LLaDA loop makes (`model(input_ids, attention_mask,
    position_ids).logits`), so oracles/bidirectional.py's published loop runs on it."""

    def __init__(self, net):
        self.net = net

    def __call__(self, input_ids, attention_mask, position_ids):
        import types
        allowed = attention_mask[:, 0].numpy()
        logits = self.net(input_ids.numpy(), allowed, position_ids.numpy())
        return types.SimpleNamespace(logits=torch.from_numpy(np.asarray(logits)))


def test_llada_moe_decodes_as_llada_s_loop_and_runs_every_cache_and_the_estimator(llada_moe, tokenizer):
    """LLaDA's decoding applies unchanged: LocalLeap without a cache equals the published eager loop (tokens, NFE) on
    the eager LLaDA-MoE network; Fast-dLLM's prefix and dual caches run; the LLaDA estimator is unbiased."""
    from oracles import bidirectional, likelihood as ref_likelihood

    model, net, _ = llada_moe
    V, mask_id, eos_id = _ids(tokenizer)
    ids, mask = _batch(V, [6, 9], seed=5, avoid=(mask_id,))
    rule = ll.rule("localleap", kappa=0.05, tau=0.02, radius=2)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=rule, gen_length=16, block_length=8))
    x, nfe = bidirectional.eager_generate(
        _AsTransformers(net), torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask), strategy="localleap",
        kappa=0.05, tau=0.02, radius=2, gen_length=16, block_length=8, mask_id=mask_id, eos_id=eos_id,
        vocab_limit=len(tokenizer))
    np.testing.assert_array_equal(np.asarray(out.tokens), x.numpy())
    assert out.nfe.tolist() == list(nfe) and max(nfe) < 16  # parallel commits happened
    for cache in ("prefix", "dual"):
        cached = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=rule, gen_length=16, block_length=8,
                                                               cache=cache))
        assert not (np.asarray(cached.tokens)[:, ids.shape[1]:] == mask_id).any() and cached.full_passes == 2
    prefix, target = [int(t) for t in ids[0][mask[0]]], [5, 17, 40]
    exact = ref_likelihood.llada_expected_loglikelihood(bidirectional_logits_fn(net), prefix, target,
                                                        mask_id=mask_id, batch_size=8)
    values = [ll.loglikelihood(model, [prefix], [target], ll.LikelihoodConfig(mc_num=32, batch_size=8, seed=s))[0]
              for s in range(8)]
    mean, err = float(np.mean(values)), float(np.std(values, ddof=1) / np.sqrt(len(values)))
    assert abs(mean - exact) < 4 * err + 1e-6, (mean, err, exact)


def bidirectional_logits_fn(net):
    return lambda ids: torch.from_numpy(np.asarray(LM.llada_moe_logits_fn(net)(np.asarray(ids))))


EXPERT_MESHES = r"""
import json, sys
import numpy as np
import jax
import localleap_jax as ll
from localleap_jax.dist.mesh import addressable_bytes

path, ids, mask = sys.argv[1], np.asarray(json.loads(sys.argv[2]), np.int32), np.asarray(json.loads(sys.argv[3]))
cfg = ll.DecodeConfig(strategy=ll.rule("dynamic", threshold=0.03, steps=12), gen_length=10, block_length=4,
                      early_stop=True)
one = ll.load(path, dtype="float32")
ref = ll.generate(one, ids, mask, cfg)
res = {}
for data, expert, model in ((2, 4, 1), (1, 8, 1), (2, 2, 2)):
    mesh = ll.make_mesh(data=data, expert=expert, model=model)
    m = ll.load(path, dtype="float32", mesh=mesh)
    leaf = m.params["layers"][-1]["moe"]["experts"]["gate_proj"]   # [E, D, F] of the last layer
    held = addressable_bytes({"x": leaf})
    out = ll.generate(m, ids, mask, cfg, mesh=mesh)
    res[f"{data}x{expert}x{model}"] = dict(
        tokens=bool((out.tokens == ref.tokens).all()), nfe=out.nfe.tolist() == ref.nfe.tolist(),
        experts_axis=leaf.shape[0], share=max(held.values()) / leaf.nbytes)
print(json.dumps(res))
"""


def test_llada2_on_meshes_with_an_expert_axis_equals_one_device(llada2, tokenizer):
    """8 fake CPU devices: the routed experts split over "expert" (each device ~1/expert of their bytes, restored
    straight into their shards) with data and model axes beside it; every mesh gives the one-device tokens and NFE."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    _, _, out = llada2
    V, mask_id, eos_id = _ids(tokenizer)
    ids, mask = _batch(V, [7, 3], seed=11, avoid=(mask_id, eos_id))
    # (the suite's quick-compile XLA flags kept beside the device count: without them this compiles twice as long)
    flags = f"--xla_force_host_platform_device_count=8 {os.environ.get('XLA_FLAGS', '')}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", EXPERT_MESHES, str(out), json.dumps(ids.tolist()),
                          json.dumps(mask.tolist())], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        expert = int(name.split("x")[1])
        assert r["tokens"] and r["nfe"], name
        assert r["experts_axis"] == 8 and abs(r["share"] - 1 / expert) < 1e-9, (name, r)


def test_the_evaluation_takes_llada2_with_its_authors_defaults(llada2, tmp_path):
    """eval_gsm8k with no --strategies and no --block-length runs LLaDA2's own (the dynamic rule at 0.95 among the
    family's strategies, its block of 32); the lm-eval adapter decodes as ll.generate does alone."""
    from lm_eval.api.instance import Instance

    from helpers import REPO
    from localleap_jax.commands import eval_gsm8k
    from localleap_jax.lm_eval import LocalLeapLM

    model, _, out = llada2
    code = eval_gsm8k.main(["--checkpoint", str(out), "--data", str(REPO.parent / "shared/data/gsm8k/test.jsonl"),
                            "--limit", "2", "--gen-length", "32", "--num-fewshot", "0", "--no-compile-cache",
                            "--output", str(tmp_path / "eval")])
    assert code == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert "dynamic:threshold=0.95" in summary["strategies"] and summary["config"]["block_length"] == 32
    lm = LocalLeapLM(model=model, compile_cache=False, progress=False, strategy="dynamic:threshold=0.03",
                     gen_length=16, block_length=8)
    ctxs = ["Question: Tom has 9 pens.\nAnswer:", "Question: Mia has 3 apples and 4 more.\nAnswer:"]
    answers = lm.generate_until([Instance("generate_until", {}, (c, {"until": []}), i) for i, c in enumerate(ctxs)])
    for ctx, answer in zip(ctxs, answers):
        ids = np.asarray([model.tokenizer.encode(ctx)], np.int32)
        assert answer == model.tokenizer.decode_generated(ll.generate(model, ids, None, lm.cfg))[0]
