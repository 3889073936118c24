"""Planning a run ahead of time: `ll.lower_generate` lowers the program `ll.generate` runs from a config alone, and
`python -m localleap_jax.plan` prints its memory and bytes per pass (on this host with a mesh of virtual CPU
devices, and, with libtpu, for a TPU topology)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO

PLAN = ["--batch", "2", "--prompt-length", "16", "--gen-length", "16", "--block-length", "8", "--cache", "dual",
        "--strategy", "threshold", "--dtype", "float32"]


def test_lower_generate_lowers_the_program_generate_runs(converted):
    """The same program: a real ll.generate on the tiny checkpoint and lower_generate from its config alone compile to
    programs of the same footprint that move the same bytes per pass; nothing but shapes went in."""
    import jax

    import localleap_jax as ll
    from localleap_jax import hlo_bytes
    from localleap_jax.compile_cache import compiled_programs
    from localleap_jax.dist import aot

    model = ll.load(converted, dtype="float32")
    cfg = ll.DecodeConfig(strategy=ll.rule("threshold", kappa=0.9), gen_length=16, block_length=8, cache="dual")
    ids = np.random.RandomState(0).randint(0, 200, (2, 16)).astype(np.int32)
    ll.generate(model, ids, np.ones_like(ids, bool), cfg)
    ran = compiled_programs()[-1].executable
    planned = aot.plan_generate(model.config, cfg, batch=2, prompt_length=16, dtype="float32", special=model.special)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(planned.params))  # no weights
    lowered = ll.lower_generate(model.config, cfg, batch=2, prompt_length=16, dtype="float32")
    assert isinstance(lowered, jax.stages.Lowered)
    compiled = planned.lowered.compile()
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        assert getattr(compiled.memory_analysis(), field) == getattr(ran.memory_analysis(), field), field
    assert hlo_bytes.loop_passes(compiled.as_text()) == hlo_bytes.loop_passes(ran.as_text())
    passes = aot.pass_cost(planned, compiled)
    params = sum(a.size * 4 for a in jax.tree.leaves(model.params))
    embedding = model.params["wte"]["embedding"].size * 4
    assert passes.weights == params - embedding  # the head is untied: the embedding is only gathered from
    c = model.config
    assert passes.kv == 2 * c.n_layers * 2 * (64 + 16) * c.n_kv_heads * c.head_dim * 4  # K and V, 2 rows, bucket + 16
    # the refresh's lanes and the guarded cached pass; a cached pass reads every weight at least once
    assert passes.cache_choices == 2 and passes.full > passes.cached > passes.weights


def run_plan(*args, env=None):
    return subprocess.run([sys.executable, "-m", "localleap_jax.plan", *args], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)


def test_the_plan_command_splits_a_run_over_a_mesh_and_prints_it(converted, tmp_path):
    out = tmp_path / "plan.json"
    r = run_plan("--checkpoint", str(converted), "--mesh", "data=1,model=2", *PLAN, "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.loads(out.read_text())
    assert p["devices"]["count"] == 2 and p["devices"]["mesh"] == {"data": 1, "model": 2}
    per = p["per_device"]
    import jax

    from localleap_jax.checkpoint.reading import abstract_params
    from localleap_jax.families import read_config_file

    whole = sum(a.size * 4 for a in jax.tree.leaves(abstract_params(read_config_file(converted / "config.json"),
                                                                    np.float32)))
    assert whole / 2 < per["parameters"] < 0.51 * whole  # every matrix split over "model" (the norms are not)
    assert per["fits"] is True and per["total"] >= per["parameters"] + per["kv_cache"]
    assert p["per_pass"]["cached"] > 0 and p["per_pass"]["cached_ratio"] > 0.5
    text = r.stdout
    assert "data=1 x model=2" in text and "cached pass" in text and "fits" in text and "GiB" in text


@pytest.mark.parametrize("args,message", [
    (["--config", "/nonexistent/config.json"], "no config.json at"),
    (["--checkpoint", "CK", "--topology", "v9z:1x1"], "topology 'v9z:1x1'"),
    (["no-such-user/no-such-model"], "offline"),
    (["--checkpoint", "CK", "--cache", "sideways"], "cache"),
])
def test_plan_mistakes_end_in_one_line(converted, args, message, capsys, monkeypatch):
    from localleap_jax.commands.plan import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", ""))  # what --topology sets is put back
    status = main([*(str(converted) if a == "CK" else a for a in args), "--batch", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message in lines[0]


def test_the_plan_command_plans_a_tpu_topology(converted, tmp_path):
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (the [tpu-aot] extra)")
    out = tmp_path / "plan.json"
    r = run_plan("--checkpoint", str(converted), "--topology", "v5e:2x4", "--mesh", "data=2,model=4", *PLAN,
                 "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.loads(out.read_text())
    assert p["devices"]["kind"] == "TPU v5e" and p["devices"]["count"] == 8
    assert p["devices"]["memory_bytes"] == 16 * 2**30 and p["per_device"]["fits"] is True
    assert p["seconds_at_bandwidth"]["cached"] > 0 and "optimal_seconds" in p["xla_estimate"]
