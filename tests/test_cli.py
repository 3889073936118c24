"""localleap_jax/cli.py, the toolkit every command line ends through: run_command's one line and exit status for each
way a command can end, the startup guard through a real command line, and the output-path check leaving nothing.
(Every command's own mistakes run through the real programs in tests/test_cli_errors.py.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO
from localleap_jax import cli
from localleap_jax.errors import CheckpointError, LostProcessError, UserError


def _ends(work, capsys, **kw):
    status = cli.run_command(work, **kw)
    return status, capsys.readouterr().err.strip().splitlines()


def _raise(e):
    def work():
        raise e
    return work


@pytest.mark.parametrize("error, line", [
    (CheckpointError("no checkpoint at /x"), "error: no checkpoint at /x"),
    (CheckpointError("two\nlines"), "error: two; lines"),  # always one line
    (PermissionError(13, "Permission denied", "/x/out"), "error: [Errno 13] Permission denied: '/x/out'"),
])
def test_a_mistake_or_the_environment_is_one_error_line_and_status_2(capsys, error, line):
    assert _ends(_raise(error), capsys) == (cli.EXIT_ERROR, [line])


def test_ctrl_c_and_sigterm_are_one_line_saying_what_was_kept_and_status_130(capsys):
    said = lambda why: f"interrupted ({why}); kept 3 answers"  # noqa: E731
    assert _ends(_raise(KeyboardInterrupt()), capsys, interrupted=said) == (130, ["interrupted (Ctrl-C); kept 3 answers"])

    def terminated():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        return 0
    before = signal.getsignal(signal.SIGTERM)
    assert _ends(terminated, capsys, interrupted=said) == (130, ["interrupted (SIGTERM); kept 3 answers"])
    assert signal.getsignal(signal.SIGTERM) is before  # put back


def test_a_finished_command_is_0_and_a_bug_or_a_lost_process_is_not_swallowed(capsys):
    assert _ends(lambda: None, capsys) == (0, [])
    assert _ends(lambda: 7, capsys) == (7, [])
    with pytest.raises(ZeroDivisionError):  # a bug: its traceback shows
        cli.run_command(lambda: 1 / 0)
    with pytest.raises(LostProcessError):  # the caller ends the process through processes.exit_lost
        cli.run_command(_raise(LostProcessError("process 1 died")))


def test_check_writable_dir_leaves_nothing_behind(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    assert cli.check_writable_dir(deep, "--output") == deep
    assert list(tmp_path.iterdir()) == []  # what the try made is gone
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"^--output \S+/f/out: \S+/f is a file, not a directory$"):
        cli.check_writable_dir(tmp_path / "f" / "out", "--output")


def test_ctrl_c_while_a_command_still_imports_is_one_line(tmp_path):
    """The startup guard (cli.guard_startup), through the real `python experiments/eval_gsm8k.py`: a Ctrl-C half a
    second in lands while JAX and lm-eval load (or, on a fast machine, at the start of the run), never a traceback."""
    p = subprocess.Popen([sys.executable, "experiments/eval_gsm8k.py", "--checkpoint", "embedded", "--output",
                          str(tmp_path / "out")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:  # a run the signal did not end is not left running
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1] in ("error: interrupted before anything was written",
                         "interrupted (Ctrl-C) before anything was generated; nothing was kept"), err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "out").exists()
