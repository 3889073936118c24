"""Ctrl-C anywhere, through the real command lines (issue #47): answered within seconds even while JAX compiles or
runs a program (the program's watchdog, localleap_jax/cli.py), never a crash, one line that says what was kept
naming the real path, and what it says was kept really kept (a rerun takes it up).

Each run waits for a state it can see (a line of the progress bar, a file) before it signals, never for a time;
the bounds on how long an answer may take are wide (two cores shared with other work) and still far below what
waiting for the compiled call to end takes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import REPO

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
ANSWERED_S = 20.0  # the watchdog ends a run GRACE_S (2 s) after a signal; the rest is a loaded machine's slack


class Running:
    """A real command line in a process of its own, its stderr (progress bars included) read as it comes."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=OFFLINE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err = bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while chunk := self.proc.stderr.read1(4096):
            self.err.extend(chunk)

    def wait_for(self, seen, what: str, timeout: float = 300.0) -> None:
        """Until `seen()` holds (the process still running), or fail naming `what`."""
        deadline = time.monotonic() + timeout
        while not seen():
            assert self.proc.poll() is None, f"ended before {what}: {self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s: {self.text()[-3000:]}"
            time.sleep(0.02)

    def interrupt(self) -> float:
        """SIGINT; returns the seconds until the process ended."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=240)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=10)
        return time.monotonic() - t0

    def text(self) -> str:
        return self.err.decode(errors="replace")

    def last_line(self) -> str:
        return [line for line in re.split(r"[\r\n]", self.text()) if line.strip()][-1]


def test_ctrl_c_inside_the_first_compiled_call_is_answered_within_seconds_and_the_bar_moves_before_it(tmp_path):
    """Issue #47: Ctrl-C during eval_gsm8k's first compiled call went unanswered until the call ended (84 s), and the
    bar stood at 0/N all through it. 100 prompts through 4 slots at one token per pass: a call of ~1600 passes.
    The bar shows the passes within the call; the Ctrl-C comes inside it and ends the run within seconds."""
    out = tmp_path / "out"
    run = Running("experiments/eval_gsm8k.py", "--checkpoint", "embedded", "--strategies", "low_confidence",
                  "--limit", "100", "--slots", "4", "--queue", "100", "--no-compile-cache", "--output", out)
    passes = lambda: [int(n) for n in re.findall(rb"pass (\d+)\]", run.err)]  # noqa: E731  (the bar's postfix)
    run.wait_for(lambda: max(passes(), default=0) >= 2, "a pass counted inside the first compiled call")
    assert b"generate [low_confidence]:   0%" in run.err and b"| 0/100 [" in run.err  # no row was done yet: mid-call
    took = run.interrupt()
    assert run.proc.returncode == 130 and "Traceback" not in run.text(), run.text()[-3000:]
    assert run.last_line() == "interrupted (Ctrl-C) before anything was generated; nothing was kept", run.text()[-2000:]
    assert took < ANSWERED_S, took
    assert not out.exists()  # it had made the directory: it goes, with its lock


def test_ctrl_c_while_analyze_dynamics_compiles_ends_in_one_line_not_a_crash(tmp_path):
    """Issue #47: a Ctrl-C while the first batch compiled ended in a segmentation fault (tearing JAX down after an
    interrupted compile) or was lost in a garbage-collector callback; and the line claimed traces were kept."""
    out = tmp_path / "out"
    run = Running("experiments/analyze_dynamics.py", "--checkpoint", "embedded", "--limit", "4", "--batch-size", "2",
                  "--no-compile-cache", "--output", out)
    run.wait_for(lambda: b"trace [low_confidence]:   0%" in run.err, "the first batch's call")
    took = run.interrupt()
    assert run.proc.returncode == 130, (run.proc.returncode, run.text()[-3000:])  # -11 before
    assert "Traceback" not in run.text() and "Fatal Python error" not in run.text(), run.text()[-3000:]
    assert run.last_line() == "interrupted (Ctrl-C) before any batch was traced; nothing was kept", run.last_line()
    assert took < ANSWERED_S, took
    assert not out.exists()


def test_ctrl_c_between_batches_keeps_every_trace_says_where_and_the_rerun_goes_on(tmp_path, capsys):
    """The finished batches' traces are kept, the line names the real directory (it said "OUT/traces") and counts
    them, and the rerun reuses them. (In this process: the signal is one a thread sends once the first trace is
    written; the run stops before its next batch.)"""
    from localleap_jax.commands import analyze_dynamics

    out = tmp_path / "out"
    argv = ["--checkpoint", "embedded", "--limit", "6", "--batch-size", "2", "--gen-length", "32", "--no-compile-cache",
            "--output", str(out)]
    first = out / "traces" / "batch-00000.npz"

    def interrupt_after_the_first_batch():
        while not first.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_after_the_first_batch, daemon=True).start()
    assert analyze_dynamics.main(argv) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    m = re.fullmatch(rf"interrupted \(Ctrl-C\): kept the traces of (\d) finished batches \((\d) problems\) in "
                     rf"{re.escape(str(out / 'traces'))}; rerun the same command to go on from them", line)
    assert m and 1 <= int(m.group(1)) < 3 and int(m.group(2)) == 2 * int(m.group(1)), line
    kept = sorted((out / "traces").glob("batch-*.npz"))
    assert len(kept) == int(m.group(1)) and not (out / ".lock").exists()
    stamps = {p.name: p.stat().st_mtime_ns for p in kept}
    assert analyze_dynamics.main(argv) == 0
    assert {p.name: p.stat().st_mtime_ns for p in kept} == stamps  # reused, not traced again
    assert len(list((out / "traces").glob("batch-*.npz"))) == 3
    assert json.loads((out / "dynamics.json").read_text())["rows"] == 6


def test_ctrl_c_keeps_every_scored_likelihood_request_and_the_rerun_scores_only_the_rest(tmp_path, capsys):
    """Issue #47: eval_likelihood interrupted at 144/240 said the scored requests were in "OUT/cache" (a literal
    OUT) and that a rerun resumes; the cache held nothing (the answers were cached only at the task's end) and the
    rerun started at 0. 48 requests (12 items x 4 choices) are scored in chunks of 16 (4 compiled calls of 4), each
    cached as it ends. (Also the command's end to end run: its summary, its table, a rerun from the cache.)"""
    from sqlitedict import SqliteDict

    from localleap_jax.commands import eval_likelihood

    out = tmp_path / "out"
    argv = ["--n-local", "12", "--mc-num", "4", "--output", str(out), "--no-progress"]
    run = Running("experiments/eval_likelihood.py", *argv)
    stats = out / "cache" / "synthetic_math_choice.stats.jsonl"
    run.wait_for(lambda: stats.is_file() and stats.read_bytes().count(b"\n") >= 16, "a chunk scored")
    run.interrupt()
    assert run.proc.returncode == 130 and "Traceback" not in run.text(), run.text()[-3000:]
    m = re.fullmatch(rf"interrupted \(Ctrl-C\): kept (\d+) requests scored by this run \(and all earlier ones\) in "
                     rf"{re.escape(str(out / 'cache'))}; rerun the same command to resume", run.last_line())
    assert m, run.last_line()
    kept = int(m.group(1))
    assert kept in (16, 32), kept  # whole chunks: the run stops between two
    (db,) = (out / "cache").glob("*.db")
    with SqliteDict(str(db)) as d:
        assert len(d) - 1 == kept  # one entry per request scored, besides the cache's claim
    assert eval_likelihood.main(argv) == 0
    task = json.loads((out / "summary.json").read_text())["tasks"]["synthetic_math_choice"]
    assert task["requests_scored"] == 48 - kept  # only what was not kept
    assert task["n"] == 12 and task["mc_num"] == 4 and task["mc_batch_size"] == 4 and 0 <= task["acc"] <= 1
    assert "synthetic_math_choice" in capsys.readouterr().out  # the table
    assert eval_likelihood.main(argv) == 0  # once more: every request from lm-eval's cache, the same accuracy
    again = json.loads((out / "summary.json").read_text())["tasks"]["synthetic_math_choice"]
    assert again["requests_scored"] == 0 and again["acc"] == task["acc"]
