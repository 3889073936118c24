"""experiments/gpu_report.py runs every section on CPU at a small shape and writes a report whose ratios are real, and
the decoder's own memory from a process that never built the PyTorch twin."""

import json
import math
import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.slow
def test_the_gpu_report_measures_every_section_and_writes_finite_ratios(tmp_path):
    path = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "experiments/gpu_report.py", "--shape", "small", "--length", "64",
                          "--gen-length", "32", "--block-length", "16", "--batch", "1", "--tokens-per-step", "8",
                          "--json", str(path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"written {path}" in run.stdout
    report = json.loads(path.read_text())
    assert report["attention_implementation"] in ("xla", "cudnn")
    sections = report["sections"]
    assert {"setup", "forward", "caches", "localleap"} <= set(sections)
    assert not any(sections[s]["skipped"] for s in ("forward", "caches", "localleap"))  # the budget held them all
    assert [r["cache"] for r in sections["caches"]["rows"]] == ["none", "prefix", "dual"]
    assert [(r["strategy"], r["cache"]) for r in sections["localleap"]["rows"]] == [("localleap", "dual")]
    ratios = [r["torch_over_jax"] for r in sections["forward"]["rows"]]
    ratios += [r["jax_over_fast_dllm"] for s in ("caches", "localleap") for r in sections[s]["rows"]]
    assert len(ratios) == 5 and all(math.isfinite(x) and x > 0 for x in ratios), ratios
    for r in sections["caches"]["rows"] + sections["localleap"]["rows"]:
        assert r["rows_agree"] == 1  # fp32 on CPU: both sides decode the same tokens
        assert r["jax_passes"] == r["fast_dllm_passes"] == (4 if r["strategy"] == "low_confidence" else r["jax_passes"])
    assert set(report["memory"]) == {"jax_peak_bytes", "torch_peak_bytes"}
    # The decoder's own memory, measured in a process that never imported torch (so never built the twin)
    decoder = report["decoder_memory"]
    assert decoder["torch_imported"] is False
    assert [r["cache"] for r in decoder["rows"]] == ["none", "prefix", "dual"]
    assert decoder["param_bytes"] == pytest.approx(report["params"] * 4, rel=1e-3)  # fp32 on the CPU
    assert all(r["program_bytes"] >= decoder["param_bytes"] for r in decoder["rows"])  # each program holds them
    assert decoder["peak_source"] == "host peak RSS" and decoder["peak_bytes"] > decoder["param_bytes"]


def test_the_report_s_default_file_is_under_runs_not_the_current_directory(tmp_path, monkeypatch):
    """Issue #47: `gpu_report.py --json` wrote gpu_report.json into the current directory (the repository) by
    default. The default is runs/gpu_report/<shape>.json, checked before anything is measured."""
    import importlib.util

    from localleap_jax.errors import UserError

    import os

    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # bench_threads adds to it: put back after
    spec = importlib.util.spec_from_file_location("gpu_report_under_test", REPO / "experiments" / "gpu_report.py")
    gpu_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_report)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # so the run stops, naming the file it would write, before measuring
    with pytest.raises(UserError, match=rf"^--json {tmp_path}/runs/gpu_report/small.json: {tmp_path}/runs is a file"):
        gpu_report.main(["--shape", "small"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
