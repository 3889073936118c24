"""The distribution wing on 8 virtual CPU devices: (data, model) meshes (dist.mesh) and pmap (dist.pmap) decode
exactly as one device; parameters are split and loaded straight into their shards.

One subprocess serves every test here: the device count is fixed when JAX starts (XLA_FLAGS), and the rest of
the suite runs on one device.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPT = r"""
import json, sys
import jax, numpy as np
import localleap_jax as ll
from localleap_jax.dist.mesh import addressable_bytes, shard_params
from localleap_jax.partition import make_mesh, param_shardings, param_specs
from localleap_jax.tokenizer import left_pad
assert jax.device_count() == 8, jax.devices()
model = ll.load(sys.argv[1], dtype="float32")
small = ll.load(sys.argv[2], dtype="float32")  # the 3-layer tiny model of the pmap check
prompts = [[5, 17, 42], [120, 3, 3, 250, 11], [77], [8, 9, 10, 11], [200, 201], [31, 32, 33, 34, 35, 36], [64]]
ids, mask = left_pad(prompts, model.config.pad_token_id)  # 7 rows: no mesh below divides them evenly
meshes = [(8, 1), (2, 4), (1, 8)]  # (4, 2): the schedule's rule below
res = {"cases": []}
for strategy in ("localleap", "low_confidence"):  # (threshold is localleap without its relaxed clause)
    for cache in ("none", "dual"):
        cfg = ll.DecodeConfig(strategy=ll.rule(strategy), gen_length=16, block_length=8, cache=cache)
        one = ll.generate(model, ids, mask, cfg)
        # every mesh for localleap; for the schedule's rule, one with data and model split and one model-only
        for data, mod in (meshes if strategy == "localleap" else [(4, 2), (1, 8)]):
            out = ll.generate(model, ids, mask, cfg, mesh=make_mesh(data, mod))
            res["cases"].append(dict(strategy=strategy, cache=cache, mesh=[data, mod],
                                     tokens=bool((out.tokens == one.tokens).all()), nfe=bool((out.nfe == one.nfe).all()),
                                     shape=list(out.tokens.shape)))
        res.setdefault("nfe_spread", []).append(sorted(set(one.nfe.tolist())))

# The field's caches on a mesh: each row's own schedule in its data shard, the weights split under their own layer
# loops (d2Cache's attention probabilities, dLLM-Cache's per-layer partial recompute).
res["field"] = {}
for cache in ("d2cache:current_k=4", "dllm_cache:prompt_interval=5,gen_interval=3"):
    cfg = ll.DecodeConfig(strategy=ll.rule("threshold"), gen_length=16, block_length=8, cache=cache)
    one, out = ll.generate(model, ids, mask, cfg), ll.generate(model, ids, mask, cfg, mesh=make_mesh(2, 4))
    res["field"][cache] = dict(tokens=bool((out.tokens == one.tokens).all()), nfe=bool((out.nfe == one.nfe).all()))

# Parameter bytes per device with model=4 (from the arrays' addressable shards).
mesh = make_mesh(2, 4)
placed = shard_params(model.params, mesh)
per_device = addressable_bytes(placed)
total = sum(a.nbytes for a in jax.tree.leaves(model.params))
specs = jax.tree.leaves(param_specs(model.params, 4), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
split = sum(a.nbytes for a, s in zip(jax.tree.leaves(model.params), specs) if any(ax is not None for ax in s))
res["bytes"] = dict(total=total, split=split, per_device=sorted(set(per_device.values())))

# Loading straight into shards: every leaf arrives split as param_specs says, holding the same values as
# the unsharded load; generate uses the arrays as they are (nothing placed again).
import tempfile
from pathlib import Path
from localleap_jax import checkpoint
from localleap_jax.dist import mesh as dist_mesh
from localleap_jax.families import write_config
loaded = ll.load(sys.argv[1], dtype="float32", mesh=mesh)
want = param_shardings(model.params, mesh)
res["loaded"] = dict(
    shardings=all(a.sharding.is_equivalent_to(w, a.ndim)  # (a slice of a split stack: P('model',) = P('model', None))
                  for a, w in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want))),
    values=all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(loaded.params),
                                                                            jax.tree.leaves(model.params))),
    per_device=sorted(set(addressable_bytes(loaded.params).values())))
dist_mesh._SHARDED_PARAMS.clear()
cfg = ll.DecodeConfig(strategy=ll.rule("localleap"), gen_length=16, block_length=8, cache="dual")
out = ll.generate(loaded, ids, mask, cfg, mesh=mesh)
res["loaded"].update(placed_again=len(dist_mesh._SHARDED_PARAMS), tokens=bool((out.tokens == ll.generate(model, ids, mask, cfg).tokens).all()))
# Without mesh=, the split weights run the one-device program compiled for their placement; the plain model then
# its own (the compiled-program key holds the inputs' shardings: it used to hand the plain model the other one).
res["loaded"]["no_mesh_then_plain"] = bool((ll.generate(loaded, ids, mask, cfg).tokens ==
                                            ll.generate(model, ids, mask, cfg).tokens).all())
# The non-finite check on a split leaf: per-shard counts summed across devices, never a gather.
leaf = loaded.params["layers"][1]["up_proj"]["kernel"]
hlo = checkpoint.count_non_finite.lower(leaf).compile().as_text()
res["finite_check"] = dict(split=str(leaf.sharding.spec), all_gather="all-gather" in hlo, all_reduce="all-reduce" in hlo)
bad = jax.tree.map(np.array, ll.families.stacked_params(model.params, model.config))  # writable host copies, stored layout
bad["blocks"]["up_proj"]["kernel"][1, 3, 5] = np.nan
tmp = Path(tempfile.mkdtemp())
with checkpoint.atomic_directory(tmp / "nan") as d:  # the plain writer: hashes match the NaN content
    checkpoint.write_checkpoint_files(d, hf_config=write_config(model.config), params=bad, tokenizer_dir=sys.argv[1],
                                      manifest={}, readme="")
try:
    ll.load(tmp / "nan", dtype="float32", mesh=mesh)
    res["nan_refused"] = ""
except ll.CheckpointError as e:
    res["nan_refused"] = str(e)

# The compiled decode step's temporary memory per device, one device vs the model split 4 ways.
from localleap_jax.compile_cache import compiled_programs, forget_compiled
def temp_bytes(m):
    cfg = ll.DecodeConfig(gen_length=16, block_length=8, cache="dual")
    forget_compiled()
    before = len(compiled_programs())
    ll.generate(model, ids[:1], mask[:1], cfg, mesh=make_mesh(1, m))
    (program,) = compiled_programs()[before:]
    return program.executable.memory_analysis().temp_size_in_bytes
res["temp"] = {"model=1": temp_bytes(1), "model=4": temp_bytes(4)}

# pmap over 4 of the devices (ll.generate(devices=...)): the same tokens as one device for a batch of 5.
pmap_prompts = [[5, 17, 42], [120, 3, 3, 250, 11], [77], [8, 9, 10, 11], [200, 201]]
pids, pmask = left_pad(pmap_prompts, small.config.pad_token_id)
four = jax.devices()[:4]
res["pmap"] = {}
for strategy in ("low_confidence", "localleap"):
    cfg = ll.DecodeConfig(strategy=ll.rules.with_shared_settings(strategy, kappa=0.5, tau=0.3), gen_length=16,
                          block_length=8)
    one = ll.generate(small, pids, pmask, cfg)
    par = ll.generate(small, pids, pmask, cfg, devices=four)
    again = ll.generate(small, pids[::-1], pmask[::-1], cfg, devices=four)  # same shapes: no recompilation
    res["pmap"][strategy] = dict(tokens=bool((one.tokens == par.tokens).all()), nfe=bool((one.nfe == par.nfe).all()),
                                 shape=list(par.tokens.shape), reversed=bool((again.tokens == par.tokens[::-1]).all()),
                                 recompiled=again.compile_seconds > 0)

# Continuous batching on a mesh and with pmap: ceil(3 / data) slots per data shard, the same tokens and NFE.
cfg = ll.DecodeConfig(strategy="low_confidence", gen_length=16, block_length=8)
one = ll.generate(small, pids, pmask, cfg)
res["slots"] = {}
for label, kw in (("mesh 2x4", dict(mesh=make_mesh(2, 4))), ("pmap 2", dict(devices=jax.devices()[:2]))):
    got = ll.generate(small, pids, pmask, cfg, slots=3, **kw)
    res["slots"][label] = dict(tokens=bool((got.tokens == one.tokens).all()), nfe=bool((got.nfe == one.nfe).all()),
                               slots=got.slots, more_passes=got.forward_passes > one.forward_passes)

# dInfer's decoders on a mesh (data and model split; 7 rows over 2 data shards): credit writes its own block
# (inserts / deletes carried, zeros), smooth carries a soft input [B, G, D] (model-split embedding table), in slots.
res["dinfer"] = {}
for label, rule, kw in (("credit 2x4", ll.rule("credit", threshold=0.5), dict(mesh=make_mesh(2, 4))),
                        ("smooth 2x4 slots 3", ll.rule("smooth", threshold=0.5), dict(mesh=make_mesh(2, 4), slots=3))):
    cfg = ll.DecodeConfig(strategy=rule, gen_length=8, block_length=4)
    one = ll.generate(model, ids, mask, cfg)
    got = ll.generate(model, ids, mask, cfg, **kw)
    res["dinfer"][label] = dict(tokens=bool((got.tokens == one.tokens).all()), nfe=bool((got.nfe == one.nfe).all()),
                                counts=[got.inserts.tolist(), got.deletes.tolist()] == [one.inserts.tolist(),
                                                                                       one.deletes.tolist()],
                                spread=len(set(one.nfe.tolist())) > 1)

# A block-diffusion model (SDAR: per-row block grids, the exact block cache) on meshes: as one device.
sdar = ll.load(sys.argv[3], dtype="float32")
sids, smask = left_pad([[5, 17, 42, 9, 9], [120, 3, 3, 250, 11, 12, 13], [77], [8, 9, 10, 11, 12, 13, 14, 15, 16]],
                       sdar.config.pad_token_id)
res["sdar"] = []
for strategy in ("localleap:kappa=0.5,tau=0.2",):
    cfg = ll.DecodeConfig(strategy=strategy, gen_length=13, block_length=4)
    one = ll.generate(sdar, sids, smask, cfg)
    # model <= 2 with data > 1: the model axis splits the 2 KV heads, not inside one (on CPU, a head split with
    # data > 1 makes XLA permute across every device while the data shards run different numbers of passes: a hang)
    for data, mod in ((4, 2), (1, 8)):
        out = ll.generate(sdar, sids, smask, cfg, mesh=make_mesh(data, mod))
        res["sdar"].append(dict(strategy=strategy, mesh=[data, mod], tokens=bool((out.tokens == one.tokens).all()),
                                nfe=bool((out.nfe == one.nfe).all()), spread=sorted(set(one.nfe.tolist()))))

# Likelihood on a mesh (requests over "data", weights over "model"): the same estimates as one device.
contexts = [[5, 17, 42], [120, 3, 3, 250, 11], [77], [8, 9, 10]]
continuations = [[9, 9], [12, 13, 14], [3], [100, 101, 102, 103, 104]]
lcfg = ll.LikelihoodConfig(mc_num=8, batch_size=4, cfg_scale=0.5, requests_per_call=3)
one = ll.loglikelihood(model, contexts, continuations, lcfg)
res["likelihood"] = {"one": one.tolist()}
for data, mod in ((2, 4),):
    res["likelihood"][f"{data}x{mod}"] = ll.loglikelihood(model, contexts, continuations, lcfg,
                                                         mesh=make_mesh(data, mod)).tolist()

# A canvas rule (DiffusionGemma's sampler, its own draws from the rng): a prompt's draws travel with it, so every
# mesh, pmap and slots decode as one device; supplied draws (canvas_noise) too.
import dataclasses, torch
sys.path.insert(0, "tests")
from test_diffusion_gemma import C, VOCAB, batch, hf_config, params_from_state, randomized
from transformers import DiffusionGemmaForBlockDiffusion
from localleap_jax.families import read_config
from localleap_jax.loaded import Model
torch.manual_seed(0)
# two layers (a sliding and a full one) of test_diffusion_gemma's five: each program on 8 devices compiles faster
hf = randomized(DiffusionGemmaForBlockDiffusion(hf_config(num_hidden_layers=2, layer_types=["sliding_attention",
                                                                                          "full_attention"])), seed=1)
with torch.no_grad():  # as test_diffusion_gemma's `damped`: fp32 noise is not multiplied up pass after pass
    hf.model.decoder.self_conditioning.down_proj.weight.mul_(0.1)
dg_config = dataclasses.replace(read_config(hf.config.to_dict()), eos_token_ids=(206, 74))
dgm = Model(dg_config, params_from_state(hf.state_dict(), dg_config), None)
gids, gmask = batch(30, [7, 5, 3, 6, 4], 7)
rule = ll.rules.EntropyBound(entropy_bound=0.5, t_min=0.05, t_max=0.2, max_denoising_steps=6, stability_threshold=0,
                             confidence_threshold=2.0)
cfg = ll.DecodeConfig(strategy=rule, gen_length=3 * C, block_length=C)
noise = np.random.default_rng(31).integers(0, VOCAB, (5, 3, 7, C))
res["canvas"] = {}
# (each DiffusionGemma program on 8 devices compiles for ~8 s: two placements drawn, one supplied)
placements = {"mesh 4x2": dict(mesh=make_mesh(4, 2)), "pmap 2 slots 3": dict(devices=jax.devices()[:2], slots=3)}
for supplied, labels in ((None, list(placements)), (noise, ["mesh 4x2"])):
    one = ll.generate(dgm, gids, gmask, cfg, jax.random.key(3), canvas_noise=supplied)
    for label in labels:
        got = ll.generate(dgm, gids, gmask, cfg, jax.random.key(3), canvas_noise=supplied, **placements[label])
        res["canvas"][f"{label}, {'supplied' if supplied is not None else 'drawn'}"] = dict(
            tokens=bool((got.tokens == one.tokens).all()), nfe=bool((got.nfe == one.nfe).all()))
    res["canvas"]["spread " + ("supplied" if supplied is not None else "drawn")] = sorted(set(one.nfe.tolist()))
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def eight_devices(converted_sharp, converted, sdar_converted):
    """What SCRIPT measured, in a process with 8 virtual CPU devices."""
    flags = f"--xla_force_host_platform_device_count=8 {os.environ.get('XLA_FLAGS', '')}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(converted_sharp), str(converted), str(sdar_converted)],
                       cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_mesh_decodes_exactly_as_one_device(eight_devices):
    res = eight_devices
    for case in res["cases"]:
        assert case["tokens"] and case["nfe"] and case["shape"][0] == 7, case
    assert len(res["cases"]) == 2 * 3 + 2 * 2  # localleap on three meshes, the schedule's rule on two; two caches each
    assert all(len(s) > 1 for s in res["nfe_spread"][:2])  # localleap: rows finish at different passes (the per-shard loop matters)


@pytest.mark.slow
def test_the_fields_caches_on_a_mesh_decode_as_one_device(eight_devices):
    field = eight_devices["field"]
    assert len(field) == 2 and all(c == dict(tokens=True, nfe=True) for c in field.values()), field


@pytest.mark.slow
def test_the_model_axis_splits_the_weights_and_the_program(eight_devices):
    res = eight_devices
    b = res["bytes"]
    print(f"parameter bytes: {b['total']} in all, {b['split']} split; per device with model=4: {b['per_device']}; "
          f"temp bytes of one decode program per device: {res['temp']}")
    # Per device: a quarter of the split (matmul) weights plus the replicated norms.
    assert max(b["per_device"]) <= 1.05 * b["total"] / 4
    assert b["split"] >= 0.99 * b["total"]  # every matmul weight of this model divides by 4
    assert res["temp"]["model=4"] < res["temp"]["model=1"]


@pytest.mark.slow
def test_a_sharded_load_lands_in_the_shards_and_is_checked_there(eight_devices):
    res, b = eight_devices, eight_devices["bytes"]
    loaded = res["loaded"]
    assert loaded["shardings"] and loaded["values"] and loaded["per_device"] == b["per_device"], loaded
    assert loaded["placed_again"] == 0 and loaded["tokens"] and loaded["no_mesh_then_plain"], loaded
    assert res["finite_check"] == {"split": "P(None, 'model')", "all_gather": False, "all_reduce": True}
    assert re.search(r"\['blocks'\]\['up_proj'\]\['kernel'\] holds 1 non-finite value", res["nan_refused"]), res["nan_refused"]


@pytest.mark.slow
def test_pmap_over_four_devices_equals_one_device(eight_devices):
    for strategy, got in eight_devices["pmap"].items():
        assert got == dict(tokens=True, nfe=True, shape=[5, got["shape"][1]], reversed=True, recompiled=False), strategy


def test_slots_on_a_mesh_and_with_pmap_equal_one_device(eight_devices):
    """5 prompts, 3 slots over 2 data shards (2 per shard, 3 prompts each): slots refilled, tokens as one device."""
    for label, got in eight_devices["slots"].items():
        assert got == dict(tokens=True, nfe=True, slots=4, more_passes=True), label


@pytest.mark.slow
def test_dinfers_decoders_on_a_mesh_and_in_slots_equal_one_device(eight_devices):
    for label, got in eight_devices["dinfer"].items():
        assert got == dict(tokens=True, nfe=True, counts=True, spread=True), label


@pytest.mark.slow
def test_a_block_diffusion_model_on_a_mesh_decodes_as_one_device(eight_devices):
    cases = eight_devices["sdar"]
    assert len(cases) == 2 and all(c["tokens"] and c["nfe"] for c in cases), cases
    assert all(len(c["spread"]) > 1 for c in cases)  # rows of different grids finish at different passes


@pytest.mark.slow
def test_likelihood_on_a_mesh_equals_one_device(eight_devices):
    import numpy as np

    scores = eight_devices["likelihood"]
    one = np.asarray(scores.pop("one"))
    assert len(scores) == 1 and np.all(one < 0)
    for mesh, values in scores.items():
        # float32 sums partitioned differently: measured differences ~1e-6 of values ~ -10..-60
        assert np.allclose(values, one, rtol=1e-5, atol=1e-4), (mesh, values, one.tolist())


@pytest.mark.slow
def test_a_canvas_rules_draws_follow_its_prompts_onto_every_placement(eight_devices):
    """DiffusionGemma's sampler (entropy_bound, sampling, its noise drawn from the rng) on 5 prompts: a 4x2 mesh and
    3 slots over pmap on 2 devices decode each prompt as one device does (a prompt's draws are keyed by its index in
    the batch and split with the rows, decode/draws.py), with its draws drawn (both) or supplied (the mesh); the rows
    stop at different passes. (Also checked once, not kept for time: a 2x4 mesh, pmap over 4, slots on a mesh, the
    supplied draws through pmap's slots; each shard on its own key, as before, failed every case.)"""
    got = dict(eight_devices["canvas"])
    spreads = [got.pop(k) for k in ("spread drawn", "spread supplied")]
    assert len(got) == 3 and all(v == dict(tokens=True, nfe=True) for v in got.values()), got
    assert all(len(s) > 1 for s in spreads), spreads  # measured: 2 and 5 different NFE
