"""experiments/eval_gsm8k.py end to end on the embedded model: files agree, reruns skip, mistakes are one line."""

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import localleap_jax as ll
from helpers import REPO, SHARED
from localleap_jax.checkpoint import EMBEDDED
from localleap_jax.commands import eval_gsm8k
from localleap_jax.gsm8k import OutputDir, UserError, local_task

pytestmark = pytest.mark.usefixtures("lm_eval_env_report_once")  # conftest: torch's environment report once


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    args = ["--checkpoint", "embedded", "--limit", "12", "--batch-size", "6", "--strategies",
            "low_confidence,localleap", "--output", str(out), "--no-compile-cache"]
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
    if not (SHARED / "data" / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"needs the GSM8K test file at {SHARED / 'data' / 'gsm8k' / 'test.jsonl'} (../shared beside the repo)")
    data = tmp_path / "test.jsonl"
    data.write_text("".join((SHARED / "data" / "gsm8k" / "test.jsonl").read_text().splitlines(True)[:3]))
    # a batch of 4 for the 3 problems (the default 32 would decode 29 filler rows: 3x the time, same answers)
    assert eval_gsm8k.main(["--checkpoint", "embedded", "--data", str(data), "--strategies", "threshold",
                            "--batch-size", "4", "--output", str(tmp_path / "o"), "--no-compile-cache"]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["strategies"]["threshold"]["n"] == 3 and summary["config"]["data"] == str(data.resolve())


@pytest.mark.parametrize("make_args, message", [
    (lambda t: ["--checkpoint", str(t / "nope")], "no checkpoint at"),
    (lambda t: ["--data", str(t / "missing.jsonl")], "no such file"),
    (lambda t: ["--data", str(t / "bad.jsonl")], r"bad.jsonl:2 needs the keys 'question' and 'answer'"),
    (lambda t: ["--data", str(t / "notjson.jsonl")], r"notjson.jsonl:1 is not valid JSON"),
    (lambda t: ["--strategies", "low_confidence,greedy"], "unknown strategy 'greedy'"),
    (lambda t: ["--gen-length", "60"], r"--gen-length 60 is not a multiple of --block-length 16"),
])
def test_mistakes_end_with_one_clear_line(tmp_path, capfd, make_args, message):
    # The command line's main in this process (each mistake is refused before anything is loaded; the real
    # `python experiments/eval_gsm8k.py` ends the same way: tests/test_cli_errors.py runs it in a process of
    # its own): an exception escaping main, a traceback, fails the test.
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    capfd.readouterr()
    try:
        code = eval_gsm8k.main([*make_args(tmp_path), "--output", str(tmp_path / "out")])
    except SystemExit as e:  # what the interpreter would exit with
        code = e.code
    assert code == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    assert re.search(message, lines[0]), lines[0]


def test_a_question_holding_the_mask_token_is_refused_in_one_line(tmp_path, capfd):
    """Issue #47: a --data question holding the mask token's text was generated and scored (the model reads the mask
    id as a position to fill). Refused in one line naming the request, before any generation, nothing written."""
    data = tmp_path / "masked.jsonl"
    rows = [{"question": "Tom has 3 pens and buys 2 more. How many pens has he?", "answer": "3 + 2 = 5\n#### 5"},
            {"question": "Sam has 4 cards. <|mdm_mask|> How many cards has he?", "answer": "#### 4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capfd.readouterr()
    code = eval_gsm8k.main(["--checkpoint", "embedded", "--data", str(data), "--strategies", "threshold",
                            "--output", str(tmp_path / "out"), "--no-compile-cache"])
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "error: request 1's context holds the mask token '<|mdm_mask|>' (id 2), which the model reads as a position to "
        "generate: remove it from the text (or spell it differently)")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- issue #8: state that must never lie or break

SMALL = ["--limit", "4", "--batch-size", "4", "--strategies", "threshold", "--no-compile-cache"]
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """(checkpoint A: a copy of the embedded model, an eval of 4 problems on it)."""
    root = tmp_path_factory.mktemp("small")
    shutil.copytree(EMBEDDED, root / "ckA")
    assert eval_gsm8k.main(["--checkpoint", str(root / "ckA"), *SMALL, "--output", str(root / "out")]) == 0
    return root / "ckA", root / "out"


def _copy_of(run_out, tmp_path):
    shutil.copytree(run_out, tmp_path / "out")
    return tmp_path / "out"


def _rows(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def _batches_generated(printed: str) -> int:
    return int(re.search(r"\((\d+) batches generated", printed).group(1))


def _set_every_answer(out, value):
    from sqlitedict import SqliteDict

    for db_path in (out / "cache").glob("*.db"):
        with SqliteDict(str(db_path), autocommit=True) as db:
            for k in [k for k, v in db.items() if isinstance(v, str)]:
                db[k] = value


def test_a_cache_holding_missing_answers_is_generated_again(small_run, tmp_path, capsys):
    """#8 item 1: `--batch-size -1` used to store None answers, and every later run into that --output died."""
    ck, base = small_run
    out = _copy_of(base, tmp_path)
    _set_every_answer(out, None)
    capsys.readouterr()
    assert eval_gsm8k.main(["--checkpoint", str(ck), *SMALL, "--output", str(out)]) == 0
    assert _batches_generated(capsys.readouterr().out) == 1
    assert [r["generated"] for r in _rows(out)] == [r["generated"] for r in _rows(base)]
    assert all(isinstance(r["generated"], str) for r in _rows(out))


def _other_model(path):
    """A different model's conversion (random weights) with the embedded model's eval setup."""
    from localleap_jax.model import init_params

    model = ll.load(EMBEDDED, dtype="float32")
    manifest = json.loads((EMBEDDED / "manifest.json").read_text())
    ll.checkpoint.save(path, model.config, init_params(model.config, jax.random.key(1), jnp.float32), EMBEDDED,
                       hf_config=json.loads((EMBEDDED / "config.json").read_text()),
                       manifest={k: manifest[k] for k in ("eval_data", "eval_data_spec", "eval_defaults")})


def test_resume_follows_the_weights_not_the_checkpoint_path(tmp_path, capsys):
    """#8 item 2: a checkpoint replaced by another model's conversion used to get the old model's answers."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    shutil.copytree(EMBEDDED, ck)
    run = lambda checkpoint: eval_gsm8k.main(["--checkpoint", str(checkpoint), *SMALL, "--output", str(out)])  # noqa: E731
    assert run(ck) == 0
    first = [r["generated"] for r in _rows(out)]
    shutil.rmtree(ck)
    _other_model(ck)
    capsys.readouterr()
    assert run(ck) == 0
    assert _batches_generated(capsys.readouterr().out) == 1
    assert [r["generated"] for r in _rows(out)] != first
    shutil.copytree(ck, tmp_path / "moved")
    assert run(tmp_path / "moved") == 0
    assert _batches_generated(capsys.readouterr().out) == 0  # the same weights elsewhere: nothing to redo


def _default_outputs(main, root, checkpoints, capfd, monkeypatch, parent):
    """The default --output each checkpoint's run names, run from ROOT (defaults are under the current directory):
    PARENT is made a file, so each run stops there in one line (before loading anything) naming the directory it
    would have used."""
    monkeypatch.chdir(root)
    (root / parent).parent.mkdir(parents=True, exist_ok=True)
    (root / parent).write_text("")
    named = []
    for ck in checkpoints:
        capfd.readouterr()
        assert main(["--checkpoint", str(ck)]) == 2
        (line,) = capfd.readouterr().err.strip().splitlines()
        m = re.fullmatch(rf"error: --output ({re.escape(str(root / parent))}/\S+): {re.escape(str(root / parent))} "
                         r"is a file, not a directory", line)
        assert m, line
        named.append(m.group(1))
    return named


def test_two_checkpoints_of_one_name_get_default_outputs_of_their_own(tmp_path, capfd, monkeypatch):
    """Issue #22: runs/a/model and runs/b/model both defaulted to runs/eval_gsm8k/model, silently."""
    a, b, copy = tmp_path / "a" / "model", tmp_path / "b" / "model", tmp_path / "c" / "model"
    shutil.copytree(EMBEDDED, a)
    shutil.copytree(EMBEDDED, copy)
    _other_model(b)
    named = _default_outputs(eval_gsm8k.main, tmp_path, [a, b, copy], capfd, monkeypatch, "runs/eval_gsm8k")
    assert named[0] != named[1] and all(re.fullmatch(r".*/model-[0-9a-f]{8}-[0-9a-f]{8}", n) for n in named), named
    assert named[2] == named[0]  # the same weights elsewhere: the same directory, so a rerun resumes


def test_runs_that_give_other_results_get_default_outputs_of_their_own(tmp_path, capfd, monkeypatch):
    """Issue #47: runs with other --strategies or --data shared one default --output, the second replacing the
    first's summary. What only changes speed (the batch) keeps the directory, so such a rerun resumes there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # each run stops in one line naming the directory it would use
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")

    def default_output(*flags):
        capfd.readouterr()
        assert eval_gsm8k.main(["--checkpoint", "embedded", *flags]) == 2
        line = capfd.readouterr().err.strip()
        m = re.fullmatch(rf"error: --output ({re.escape(str(tmp_path))}/runs/eval_gsm8k/\S+): \S+ is a file, not a "
                         r"directory", line)
        assert m, line
        return m.group(1)

    threshold = default_output("--strategies", "threshold")
    assert default_output("--strategies", "threshold", "--batch-size", "8") == threshold
    others = [default_output("--strategies", "threshold,localleap"), default_output("--strategies", "localleap"),
              default_output("--strategies", "threshold", "--data", str(tmp_path / "q.jsonl")),
              default_output("--strategies", "threshold", "--limit", "3")]
    assert len({threshold, *others}) == 5, others


def test_a_torn_stats_record_is_dropped_and_its_answer_generated_again(small_run, tmp_path, capsys):
    """#8 item 7: a stats log cut mid-record (kill -9, full disk) used to fail every rerun with JSONDecodeError."""
    ck, base = small_run
    out = _copy_of(base, tmp_path)
    (stats,) = (out / "cache").glob("*.stats.jsonl")
    stats.write_bytes(stats.read_bytes()[:-25])
    capsys.readouterr()
    assert eval_gsm8k.main(["--checkpoint", str(ck), *SMALL, "--output", str(out)]) == 0
    assert _batches_generated(capsys.readouterr().out) == 1  # the one request whose record was torn
    # (timings, and how the call that generated a row was laid out: the one answer is regenerated alone)
    strip = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "compile_seconds", "passes_share", "slots")}
    assert [strip(r) for r in _rows(out)] == [strip(r) for r in _rows(base)]


def test_a_lock_left_by_a_dead_run_is_taken_over_and_a_live_one_refuses(tmp_path):
    """#8 item 8: two runs into one --output used to both redo everything and interleave their stats."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text(json.dumps({"pid": 999999, "host": "elsewhere", "since": "yesterday"}))
    first = OutputDir(out)
    note = first.claim()
    assert note.endswith("left by a run that ended without releasing it (pid 999999 on elsewhere since yesterday)")
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    with pytest.raises(UserError, match=rf"--output {out} is in use by another run \(pid {os.getpid()} "):
        OutputDir(out).claim()
    first.release()
    assert not (out / ".lock").exists()
    again = OutputDir(out)
    assert again.claim() is None
    again.release()


def test_truncate_fewshot_fits_over_long_prompts_and_counts_them(small_run, tmp_path):
    """#8 item 4: over-long prompts used to be cut from the left, silently, losing BOS and the chat header."""
    ck, _ = small_run
    out = tmp_path / "out"
    assert eval_gsm8k.main(["--checkpoint", str(ck), *SMALL, "--num-fewshot", "30", "--truncate-fewshot",
                            "--output", str(out)]) == 0
    rows = _rows(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["truncate_fewshot"] is True
    assert summary["strategies"]["threshold"]["truncated"] == sum(r["fewshot_dropped"] > 0 for r in rows) == 4
    assert all(0 < r["fewshot_dropped"] < 30 and r["prompt_tokens"] <= 512 - 64 for r in rows)


def test_fewshot_examples_drawn_from_the_test_file_never_hold_the_problem_itself(tmp_path):
    from lm_eval.tasks import TaskManager

    data = tmp_path / "test.jsonl"  # no train.jsonl beside it: examples come from this file
    data.write_text("".join(json.dumps({"question": f"Problem number {n}: what is {n} + 1?", "answer": f"#### {n + 1}"})
                            + "\n" for n in range(4)))
    name, include = local_task(tmp_path / "out", data, data)
    task = TaskManager(include_path=str(include), include_defaults=False).load([name])["tasks"][name]
    task.set_config(key="num_fewshot", value=3)
    task.build_all_requests(limit=None, rank=0, world_size=1)
    assert len(task.instances) == 4
    for inst in task.instances:
        context = inst.args[0]
        assert context.count("Problem number") == 4 and context.count(inst.doc["question"]) == 1


def test_ctrl_c_keeps_what_is_done_says_so_in_one_line_and_the_rerun_resumes(small_run, tmp_path, capsys):
    ck, _ = small_run
    out = tmp_path / "out"
    args = ["--checkpoint", str(ck), "--limit", "40", "--batch-size", "2", "--strategies", "threshold",
            "--no-compile-cache", "--output", str(out)]
    p = subprocess.Popen([sys.executable, "experiments/eval_gsm8k.py", *args], cwd=REPO, env=OFFLINE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not any(f.stat().st_size for f in out.glob("cache/*.stats.jsonl")):  # the first batch is done
        assert p.poll() is None and time.time() < deadline, p.communicate()[1][-3000:]
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"interrupted \(Ctrl-C\): kept (\d+) answers generated by this run \(and all earlier ones\) "
                     rf"in {out}/cache; rerun the same command to resume", last)
    assert m, last
    (db,) = out.glob("cache/*.db")
    from sqlitedict import SqliteDict
    with SqliteDict(str(db)) as d:
        cached = sum(isinstance(v, str) for v in d.values())
    assert 2 <= int(m.group(1)) <= cached < 40
    assert not (out / ".lock").exists() and not (out / "summary.json").exists()
    capsys.readouterr()
    assert eval_gsm8k.main(args) == 0
    # only what was not kept, in calls of --queue's default 4 x --slots (= --batch-size 2) prompts
    assert _batches_generated(capsys.readouterr().out) == -(-(40 - cached) // 8)
    assert len(_rows(out)) == 40


class _FullDiskCursor:
    """A sqlite cursor of lm-eval's response cache (sqlitedict's writer thread) whose writes fail, after `budget`
    of them, as SQLite's own on a full disk."""

    def __init__(self, cursor, budget):
        self.cursor, self.budget = cursor, budget

    def execute(self, req, *arg):
        if req.lstrip().upper().startswith(("REPLACE", "INSERT")):
            if self.budget[0] <= 0:
                raise sqlite3.OperationalError("database or disk is full")
            self.budget[0] -= 1
        return self.cursor.execute(req, *arg)

    def __iter__(self):
        return iter(self.cursor)


def test_a_full_disk_under_the_response_cache_is_one_line_and_the_rerun_resumes(small_run, tmp_path, capfd, caplog,
                                                                                 monkeypatch):
    """Issue #22: a full disk mid-run ended in ~97 lines of sqlite3.OperationalError (sqlitedict's writer thread
    logs the traceback piece by piece, then the main thread raises it)."""
    import sqlitedict

    ck, _ = small_run
    out = tmp_path / "out"
    args = ["--checkpoint", str(ck), *SMALL, "--batch-size", "2", "--queue", "2", "--output", str(out)]
    connect, budget = sqlitedict.SqliteMultithread._connect, [3]  # the first call's two answers and one more fit

    def full_disk_connect(self):
        conn, cursor = connect(self)
        return conn, _FullDiskCursor(cursor, budget)

    monkeypatch.setattr(sqlitedict.SqliteMultithread, "_connect", full_disk_connect)
    capfd.readouterr()
    assert eval_gsm8k.main(args) == 2
    err = capfd.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:") or "Error" in line]
    assert lines == [lines[-1]] and "Traceback" not in err, err[-3000:]
    assert re.fullmatch(r"error: the disk is full: lm-eval's response cache could not be written "
                        r"\(sqlite3.OperationalError: database or disk is full\); kept 2 answers generated by this run "
                        rf"\(and all earlier ones\) in {re.escape(str(out))}/cache; free some space and rerun the same "
                        r"command to resume", lines[-1]), lines[-1]
    assert not [r for r in caplog.records if r.name.startswith("sqlitedict")]  # its traceback pieces, silenced
    monkeypatch.undo()
    assert eval_gsm8k.main(args) == 0  # space freed: the rerun generates what the cache did not keep
    assert len(_rows(out)) == 4 and _batches_generated(capfd.readouterr().out) == 1  # the one answer not cached


def test_sighup_keeps_what_is_done_says_so_in_one_line_and_the_rerun_resumes(small_run, tmp_path, capfd, monkeypatch):
    """Issue #22: SIGHUP (the terminal or session went away) killed the run with nothing said; SIGTERM and Ctrl-C
    already kept what was done (test_ctrl_c_... above runs Ctrl-C through the real program)."""
    import threading

    ck, _ = small_run
    out = tmp_path / "out"
    args = ["--checkpoint", str(ck), *SMALL, "--limit", "8", "--batch-size", "2", "--queue", "2", "--output", str(out)]

    # The hang-up comes once the first call's answers are counted (the progress bar's callback runs after
    # that); waiting on the stats file raced the count, which is written just before it, and a SIGHUP in
    # between rightly keeps nothing.
    from localleap_jax.gsm8k.progress import RunningAccuracy

    counted = threading.Event()
    count = RunningAccuracy.__call__

    def count_and_say(self, *a, **k):
        count(self, *a, **k)
        counted.set()

    monkeypatch.setattr(RunningAccuracy, "__call__", count_and_say)

    def hang_up_after_the_first_call():
        counted.wait(timeout=120)
        os.kill(os.getpid(), signal.SIGHUP)

    watcher = threading.Thread(target=hang_up_after_the_first_call, daemon=True)
    capfd.readouterr()
    watcher.start()
    assert eval_gsm8k.main(args) == 130
    watcher.join()
    last = capfd.readouterr().err.strip().splitlines()[-1]
    m = re.fullmatch(rf"interrupted \(SIGHUP\): kept (\d+) answers generated by this run \(and all earlier ones\) "
                     rf"in {re.escape(str(out))}/cache; rerun the same command to resume", last)
    assert m and 2 <= int(m.group(1)) < 8, last
    assert eval_gsm8k.main(args) == 0
    assert len(_rows(out)) == 8 and _batches_generated(capfd.readouterr().out) <= 3  # only what was not kept


def test_the_embedded_block_diffusion_model_runs_with_its_family_s_defaults(tmp_path, capfd):
    """`--checkpoint embedded-sdar` (the shipped SDAR-architecture twin): blocks of its block_size, the exact block
    cache, SDAR's dynamic rule among the default strategies, and parallel decoding at a fraction of the NFE of
    one token per pass. (Two strategies run here: each costs a compile; the defaults are read from the code.)"""
    from localleap_jax.gsm8k import default_strategies, read_model_config
    from localleap_jax.rules import split_specs

    config = read_model_config(EMBEDDED.parent / "tiny-math-sdar")
    assert split_specs(default_strategies(config)) == ["low_confidence", "dynamic:threshold=0.9", "threshold",
                                                      "localleap"]
    assert split_specs(default_strategies(read_model_config(EMBEDDED)))[0] == "low_confidence"
    out = tmp_path / "out"
    assert eval_gsm8k.main(["--checkpoint", "embedded-sdar", "--limit", "16", "--batch-size", "16", "--strategies",
                            "low_confidence,dynamic:threshold=0.9", "--output", str(out), "--no-compile-cache"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    err = capfd.readouterr().err
    # lm-eval's notes on what the run asked for on purpose are silenced (the case: 0-shot over a 5-shot task)
    assert "Overwriting default num_fewshot" not in err and "Generating test split" not in err
    assert summary["config"]["num_fewshot"] == 0
    assert summary["config"]["block_length"] == 4 and summary["config"]["cache"] == "auto"
    got = summary["strategies"]
    # Measured on the first 16 problems: 0.9375 strict for both, NFE 66.1 (one token per pass, the grid's tail past
    # gen_length 64 included) vs 18.1; on all 500 every default strategy scores 0.840.
    for name, s in got.items():
        assert s["accuracy_strict"] >= 0.8, (name, s)
    assert got["dynamic:threshold=0.9"]["mean_nfe"] < 0.4 * got["low_confidence"]["mean_nfe"]
    assert got["low_confidence"]["mean_nfe"] >= 64  # one token per pass over at least gen_length positions


def test_a_checkpoint_s_manifest_names_its_own_default_strategies():
    """`eval_defaults.strategies` (what train_tiny writes for the chain task) wins over the family's default, and
    is not taken for a canvas setting."""
    from localleap_jax.gsm8k import default_strategies, model_defaults, read_model_config

    config = read_model_config(EMBEDDED)
    manifest = {"eval_defaults": {"gen_length": 64, "strategies": "low_confidence,threshold:kappa=0.5"}}
    assert default_strategies(config, manifest) == "low_confidence,threshold:kappa=0.5"
    assert default_strategies(config, {}) == default_strategies(config) == "low_confidence,threshold,localleap"
    assert "strategies" not in model_defaults(manifest, config) and model_defaults(manifest, config)["gen_length"] == 64


def test_the_shared_flags_map_onto_each_strategy_that_has_them_and_never_over_its_spec():
    """--kappa 0.8 --tau 0.6 --radius 2 --steps 16 with several strategies: each takes what it has, a strategy's own
    spec wins, and a rule without a flag's setting ignores it (EvalSettings.decode_config, the one mapping)."""
    from localleap_jax.gsm8k.settings import EvalSettings

    settings = EvalSettings(gen_length=64, block_length=16, num_fewshot=5, batch_size=4, kappa=0.8, tau=0.6, radius=2,
                            steps=16)
    want = {"low_confidence": ll.rule("low_confidence", steps=16), "threshold": ll.rule("threshold", kappa=0.8),
            "localleap:kappa=0.95": ll.rule("localleap", kappa=0.95, tau=0.6, radius=2),
            "eb:gamma=0.1": ll.rule("eb", gamma=0.1)}
    for strategy, rule in want.items():
        cfg = settings.check(strategy)
        assert type(cfg.rule) is type(rule) and cfg.rule.spec() == rule.spec(), strategy
        assert (cfg.gen_length, cfg.block_length) == (64, 16)


def test_the_live_accuracy_waits_for_enough_answers():
    from types import SimpleNamespace

    from localleap_jax.gsm8k.progress import RunningAccuracy

    acc = RunningAccuracy(shown_after=4)
    req = SimpleNamespace(doc={"answer": "3 + 4 = 7\n#### 7"})
    acc([req] * 3, ["#### 7", "#### 7", "#### 7"], None)
    assert acc.postfix == {}  # three answers, all right: a 1.000 that says nothing yet
    acc([req], ["#### 8"], None)
    assert acc.postfix == {"acc": "0.750 of 4"}


# ---------------------------------------------------------------- issue #22: your rule in every command

MINE = ["--limit", "2", "--batch-size", "2", "--gen-length", "16", "--block-length", "16", "--no-compile-cache"]


def test_a_users_rule_file_runs_by_name_and_an_edit_reruns_exactly_it(tmp_path, capsys):
    from helpers import rules_put_back, write_user_rules

    rules, out = write_user_rules(tmp_path / "myrules.py"), tmp_path / "out"
    args = ["--rules", str(rules), "--strategies", "steady,threshold", *MINE, "--output", str(out)]

    def run():
        capsys.readouterr()
        assert eval_gsm8k.main(args) == 0
        printed = capsys.readouterr().out
        generated = {n: int(re.search(rf"^{n}: .*\((\d+) batches generated", printed, re.M).group(1))
                     for n in ("steady", "threshold")}
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        return generated, json.loads((out / "summary.json").read_text()), rows

    with rules_put_back():
        first, summary, rows = run()
        assert first == {"steady": 1, "threshold": 1}
        steady = summary["strategies"]["steady"]
        # the full spec (its default k written out) and the code's digest and place, beside the built-in's
        assert steady["spec"] == "steady:k=2" and steady["rule_defined_in"] == [f"{rules.resolve()}:Steady"]
        assert summary["strategies"]["threshold"]["spec"] == "threshold:kappa=0.9"
        assert summary["strategies"]["threshold"]["rule_defined_in"] == ["localleap_jax.rules.confidence:Threshold"]
        assert [s["source"] for s in summary["config"]["rule_sources"]] == [str(rules.resolve())]
        assert {r["strategy"] for r in rows} == {"steady", "threshold"}
        assert run()[0] == {"steady": 0, "threshold": 0}  # unchanged: everything read back

        write_user_rules(rules, edited=True)  # Steady now waits one pass longer
        again, edited, new_rows = run()
        assert again == {"steady": 1, "threshold": 0}  # the edited rule generates again, the built-in is reused
        assert edited["strategies"]["steady"]["rule_code"] != steady["rule_code"]
        assert edited["strategies"]["threshold"] == {**summary["strategies"]["threshold"],
                                                     "speedup": edited["strategies"]["threshold"]["speedup"],
                                                     "nfe_ratio": edited["strategies"]["threshold"]["nfe_ratio"]}
        # nothing stale: the edited rule's rows and summary are its new answers (one pass more each)
        nfe = lambda rs: [r["nfe"] for r in rs if r["strategy"] == "steady"]  # noqa: E731
        assert nfe(new_rows) != nfe(rows) and edited["strategies"]["steady"]["mean_nfe"] == sum(nfe(new_rows)) / 2
        assert len(list((out / "cache").glob("steady-*_rank0.db"))) == 2  # the old code's answers stay under their key


def test_the_embedded_chain_model_scores_one_token_per_pass_above_a_low_threshold(tmp_path):
    """The model `eval_gsm8k.py` runs when none is named (the README main job's, embedded-chain): its manifest's own
    task (six-step chains), canvas (gen 80) and default strategies, and on its first 64 held-out problems committing
    everything above 0.5 at once loses what one token per pass gets right -- the trade-off tiny-math cannot show."""
    from localleap_jax.checkpoint import EMBEDDED_CHAIN
    from localleap_jax.gsm8k import default_strategies, read_model_config
    from localleap_jax.rules import split_specs

    manifest = json.loads((EMBEDDED_CHAIN / "manifest.json").read_text())
    assert manifest["eval_data_spec"]["task"] == "chain6" and manifest["eval_defaults"]["gen_length"] == 80
    assert split_specs(default_strategies(read_model_config(EMBEDDED_CHAIN), manifest)) == [
        "low_confidence", "threshold:kappa=0.5", "threshold", "localleap"]
    out = tmp_path / "out"
    # 64 x 80 passes of one token: in a process of its own, whose XLA optimises as a user's does (the suite's
    # unoptimised programs, set in conftest for its many short tests, run this in twice the time).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, str(REPO / "experiments" / "eval_gsm8k.py"), "--limit", "64",  # no model
                          "--strategies", "low_confidence,threshold:kappa=0.5", "--output", str(out),
                          "--no-compile-cache"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["gen_length"] == 80
    rows = _rows(out)
    assert all(r["question"].endswith("What is g?") for r in rows)  # the chain6 split, not tiny-math's problems
    one, low = summary["strategies"]["low_confidence"], summary["strategies"]["threshold:kappa=0.5"]
    # Measured on these 64: 0.828 strict at NFE 80.0 against 0.766 at 6.8 (all 500: 0.844 against 0.770); the
    # previous chain model (six stages, 122 min) 1.000 against 0.922, tiny-math about level (0.834 against 0.838
    # on its 500). Asserted: 50 of 64 (three below), a gap of three problems (four measured).
    assert one["accuracy_strict"] >= 0.78 and one["mean_nfe"] == 80
    assert low["accuracy_strict"] <= one["accuracy_strict"] - 3 / 64 and low["mean_nfe"] < 0.1 * one["mean_nfe"]


def test_a_damaged_response_cache_is_named_in_one_line_and_the_advised_rerun_works(small_run, tmp_path, capfd):
    """Issue #47: a truncated .db ended in sqlitedict's "Exception in thread" traceback, then advice to rerun that
    failed the same way, naming no file."""
    ck, base = small_run
    out = _copy_of(base, tmp_path)
    (db,) = (out / "cache").glob("*.db")
    db.write_bytes(db.read_bytes()[:5000])
    args = ["--checkpoint", str(ck), *SMALL, "--output", str(out)]
    capfd.readouterr()
    assert eval_gsm8k.main(args) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line == (f"error: the response cache {db} is damaged (sqlite3.DatabaseError: database disk image is "
                    "malformed); delete it and rerun (the answers it held are generated again)"), line
    db.unlink()  # as the line says
    assert eval_gsm8k.main(args) == 0
    assert _batches_generated(capfd.readouterr().out) == 1 and len(_rows(out)) == 4


def test_answers_reused_from_a_run_with_other_batch_settings_are_marked_in_the_table(small_run, tmp_path, capsys):
    """Issue #47: a resumed run's table put an earlier run's rows (timed with other batch settings) beside this run's
    with nothing to tell them apart; greedy answers do not depend on the batch, so they are reused, and marked."""
    ck, base = small_run
    out = _copy_of(base, tmp_path)  # threshold's 4 answers, generated in a batch of 4
    capsys.readouterr()
    assert eval_gsm8k.main(["--checkpoint", str(ck), "--limit", "4", "--batch-size", "2", "--strategies",
                            "low_confidence,threshold", "--no-compile-cache", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^threshold: .*\(0 batches generated", printed, re.M)  # the case: reused
    assert re.search(r"^threshold \*\s", printed, re.M) and not re.search(r"^low_confidence \*", printed, re.M)
    assert re.search(r"^\* threshold: 4 of 4 answers come from an earlier run's cache, generated with other batch "
                     r"settings \(batch_size 4, slots 4, queue 16, devices 1\): their speed \(speedup, tok/s, "
                     r"s/sample, passes, occupied\) is that run's", printed, re.M), printed
    summary = json.loads((out / "summary.json").read_text())["strategies"]
    assert summary["threshold"]["timed_elsewhere"] == 4 and summary["low_confidence"]["timed_elsewhere"] == 0


def test_fixed_batches_of_slots_are_filled_to_the_slots_not_the_batch_size(small_run, tmp_path):
    """Issue #47: --slots 8 --queue 8 padded every call to --batch-size (32 by default): occupancy 0.23, 6.6x slower.
    Here --slots 4 --queue 4: each call holds 4 rows (the compiled program of the fixture's batch of 4)."""
    ck, _ = small_run
    out = tmp_path / "out"
    assert eval_gsm8k.main(["--checkpoint", str(ck), "--limit", "6", "--slots", "4", "--queue", "4", "--strategies",
                            "threshold", "--no-compile-cache", "--output", str(out)]) == 0
    rows = _rows(out)
    assert len(rows) == 6 and {r["slots"] for r in rows} == {4}  # 32 before: the rows held, filler included
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["batch_size"] == 4 and summary["strategies"]["threshold"]["occupancy"] > 0.5


STUCK_RULE = """
import flax
import localleap_jax as ll
from localleap_jax.rules import Decision, RuleBase


@ll.register("stuck")
@flax.struct.dataclass
class Stuck(RuleBase):
    \"\"\"Commits every candidate and takes everything back: no pass makes progress, every row meets the bound.\"\"\"
    remask_names = ("undo",)

    def update(self, s, state):
        return Decision(s.candidates, s.decoded | s.candidates), state
"""


def test_answers_stopped_by_the_pass_bound_are_in_the_table_and_in_the_dynamics(tmp_path, capsys):
    """Issue #47: rows that hit the pass bound (`hit_bound`) were in summary.json only: eval_gsm8k's table and
    analyze_dynamics said nothing of them."""
    from helpers import rules_put_back

    from localleap_jax.commands import analyze_dynamics

    rules = tmp_path / "stuck.py"
    rules.write_text(STUCK_RULE)
    with rules_put_back():
        assert eval_gsm8k.main(["--checkpoint", "embedded", "--rules", str(rules), "--strategies", "stuck",
                                "--limit", "2", "--batch-size", "2", "--no-compile-cache", "--output",
                                str(tmp_path / "eval")]) == 0
        printed = capsys.readouterr().out
        header = next(line for line in printed.splitlines() if line.startswith("strategy "))
        assert header.split()[-2:] == ["n", "bound"], header
        assert re.search(r"^stuck\s.*\s2\s+2$", printed, re.M), printed  # n 2, bound 2
        assert "bound: answers stopped by the pass bound (max_passes) with masks left" in printed
        assert analyze_dynamics.main(["--checkpoint", "embedded", "--rules", str(rules), "--strategy", "stuck",
                                      "--limit", "2", "--batch-size", "2", "--no-compile-cache", "--output",
                                      str(tmp_path / "dyn")]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^rows stopped by the pass bound, masks left\s+2\s+-\s+\(of 2; rows 0, 1: ", printed, re.M), printed
    result = json.loads((tmp_path / "dyn" / "dynamics.json").read_text())
    assert result["hit_bound"] == 2 and result["hit_bound_rows"] == [0, 1]
