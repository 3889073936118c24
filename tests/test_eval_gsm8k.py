"""experiments/eval_gsm8k.py end to end on the embedded model: files agree, reruns skip, mistakes are one line."""

import json
import subprocess
import sys

import pytest

import eval_gsm8k
from conftest import REPO, SHARED


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    args = ["--limit", "12", "--batch-size", "6", "--strategies", "low_confidence,localleap", "--output", str(out),
            "--no-compile-cache"]
    assert eval_gsm8k.main(args) == 0
    return out, args


def test_summary_agrees_with_samples(run_dir):
    out, _ = run_dir
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(rows) == 24 and {r["strategy"] for r in rows} == {"low_confidence", "localleap"}
    for name, s in summary["strategies"].items():
        mine = [r for r in rows if r["strategy"] == name]
        assert s["n"] == len(mine) == 12
        assert s["accuracy_strict"] == pytest.approx(sum(r["correct_strict"] for r in mine) / 12)
        assert s["accuracy_flexible"] == pytest.approx(sum(r["correct_flexible"] for r in mine) / 12)
        assert s["mean_nfe"] == pytest.approx(sum(r["nfe"] for r in mine) / 12)
        assert s["seconds_per_sample"] == pytest.approx(sum(r["seconds"] for r in mine) / 12)
        for r in mine:
            assert r["correct_strict"] == (r["filtered_strict"] == r["gold"])
            assert set(r) >= {"id", "strategy", "generated", "gold", "correct_strict", "correct_flexible", "nfe",
                              "seconds", "prompt_tokens"}
    assert all(r["nfe"] == 64 for r in rows if r["strategy"] == "low_confidence")  # one token per step
    assert summary["strategies"]["localleap"]["nfe_ratio"] < 0.5
    assert summary["config"]["gen_length"] == 64 and summary["config"]["num_fewshot"] == 0


def test_rerun_skips_what_is_done(run_dir, capsys):
    out, args = run_dir
    before = (out / "summary.json").read_text()
    capsys.readouterr()
    assert eval_gsm8k.main(args) == 0
    printed = capsys.readouterr().out
    assert "low_confidence: " in printed and "(0 batches generated" in printed
    assert printed.count("(0 batches generated") == 2
    after = json.loads((out / "summary.json").read_text())
    for name, s in json.loads(before)["strategies"].items():
        assert after["strategies"][name]["accuracy_strict"] == s["accuracy_strict"]
        assert after["strategies"][name]["mean_nfe"] == s["mean_nfe"]


def test_real_gsm8k_file_runs_through_the_same_path(tmp_path):
    data = tmp_path / "test.jsonl"
    data.write_text("".join((SHARED / "data" / "gsm8k" / "test.jsonl").read_text().splitlines(True)[:3]))
    assert eval_gsm8k.main(["--data", str(data), "--strategies", "threshold", "--output", str(tmp_path / "o"),
                            "--no-compile-cache"]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["strategies"]["threshold"]["n"] == 3 and summary["config"]["data"] == str(data.resolve())


@pytest.mark.parametrize("make_args, message", [
    (lambda t: ["--checkpoint", str(t / "nope")], "no checkpoint at"),
    (lambda t: ["--data", str(t / "missing.jsonl")], "no such file"),
    (lambda t: ["--data", str(t / "bad.jsonl")], r"bad.jsonl:2 needs the keys 'question' and 'answer'"),
    (lambda t: ["--data", str(t / "notjson.jsonl")], r"notjson.jsonl:1 is not valid JSON"),
    (lambda t: ["--strategies", "low_confidence,greedy"], "unknown strategy greedy"),
    (lambda t: ["--gen-length", "60"], "gen_length=60 is not a multiple of block_length=16"),
])
def test_mistakes_end_with_one_clear_line(tmp_path, make_args, message):
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    r = subprocess.run([sys.executable, "experiments/eval_gsm8k.py", *make_args(tmp_path), "--output",
                        str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr
    import re
    assert re.search(message, lines[0]), lines[0]
