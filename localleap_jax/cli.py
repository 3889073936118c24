"""What every command line of the project shares: how it reads flags and how it ends.

    from localleap_jax import cli

    def main(argv=None) -> int:
        ap = cli.OneLineParser(description=__doc__)
        ap.add_argument("--limit", type=cli.positive)
        args = ap.parse_args(argv)                      # a bad flag: one `error: ...` line, exit 2
        return cli.run_command(lambda: work(args), interrupted=lambda why: f"interrupted ({why}); ...")

How a command ends: 0 when it finished; EXIT_ERROR (2) with one `error: ...` line for a mistake a user can fix
(any `LocalLeapError`, the library's one error base, and any OSError: the environment, not the code: a
directory that cannot be written, a full disk); EXIT_INTERRUPTED (130, what a shell reports for Ctrl-C) with one
line saying what was kept, for Ctrl-C, SIGTERM (a scheduler's kill, `timeout`) or SIGHUP (the terminal went
away). A Ctrl-C while a command is still importing its heavy modules (`guard_startup`) ends it in one line too.
An output directory that cannot be written is found before any work (`check_writable_dir`).

A leaf: it imports nothing of the package but `errors`, so it costs nothing to import before anything heavy.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from localleap_jax.errors import LocalLeapError, LostProcessError, UserError

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# The model a command runs when none is named (eval_gsm8k, sweep, analyze_dynamics, the lm-eval adapter): the embedded
# chain model (localleap_jax/assets/tiny-chain), on which one token per pass, a low threshold and LocalLeap score
# apart. "embedded" is tiny-math (every rule scores alike there), "embedded-sdar" its block-diffusion twin,
# "embedded-dg" its DiffusionGemma twin.
DEFAULT_CHECKPOINT = "embedded-chain"

# Signals that end a command as Ctrl-C does: a scheduler's kill, `timeout`, a closed terminal or session.
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


# ---------------------------------------------------------------- flags


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a mistake in one `error: ...` line, exit status 2 (its own prints the usage
    first)."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def whole_number(low: int, what: str) -> Callable[[str], int]:
    """A flag type: an integer >= low; `what` names it in the error ("a positive integer")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


positive = whole_number(1, "a positive integer")
count = whole_number(0, "an integer >= 0")


def probability(text: str) -> float:
    """A flag type: a number in (0, 1] (a confidence threshold)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def seed(text: str) -> int:
    """A flag type: a random seed, 0 <= seed < 2**32 (what NumPy and JAX take)."""
    value = count(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer below 2**32, got {value}")
    return value


# ---------------------------------------------------------------- output paths


def check_writable_dir(directory: str | Path, flag: str, named: str | Path | None = None) -> Path:
    """`directory` (resolved), a directory a command will create or write into, tried before any work: a command
    whose output cannot be written says so in one line before it starts, not after an hour of work. The try makes
    the missing directories and a nameless file in it, then removes what it made, so nothing is left behind.

    `flag` and `named` (what the user gave, default `directory`) name the output in the UserError: "--output X is
    a file, not a directory", "--output X: P is a file, not a directory" (P above X), "--output X: cannot write
    there (Permission denied)". As root, a read-only directory can be written; a path under a regular file or on a
    read-only file system cannot."""
    directory = Path(directory).expanduser().resolve()
    named = Path(named).expanduser().resolve() if named is not None else directory
    where = f"{flag} {named}"
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"{where} is a file, not a directory" if existing == named else
                        f"{where}: {existing} is a file, not a directory")
    made = [p for p in (directory, *directory.parents) if not p.exists()]  # deepest first
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise UserError(f"{where}: cannot write there ({e.strerror or e})") from None
    finally:
        for p in made:  # empty unless someone else wrote there meanwhile: then theirs stays
            try:
                p.rmdir()
            except OSError:
                break
    return directory


# ---------------------------------------------------------------- signals


def _interrupted_while_starting(signum, frame):
    # os._exit, not an exception: unwinding out of a half-imported C extension can crash the interpreter.
    print("error: interrupted before anything was written", file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)


def guard_startup() -> None:
    """Call first thing in a command's `__main__`, before its heavy imports (JAX, lm-eval, transformers: seconds):
    a Ctrl-C, SIGTERM or SIGHUP meanwhile ends the process in one line (exit 130) instead of a traceback from
    inside an import. `run_command` lifts the guard when the command's work starts. Signals someone else
    already handles are left alone."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    for sig in TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _interrupted_while_starting)


def _lift_startup_guard() -> None:
    for sig in (signal.SIGINT, *TERMINATING):
        if signal.getsignal(sig) is _interrupted_while_starting:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@contextmanager
def terminating_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt (named after the signal) inside the block, so they end the
    work as Ctrl-C does: cleaning up as it unwinds, keeping what is done."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    previous = {sig: signal.signal(sig, interrupt) for sig in TERMINATING}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


# ---------------------------------------------------------------- how a command ends


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its lines joined), or its type's name when it has none."""
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text or type(e).__name__


def _interrupted(why: str) -> str:
    return f"interrupted ({why})"


def run_command(work: Callable[[], int | None], interrupted: Callable[[str], str] = _interrupted) -> int:
    """`work()`'s exit status (None: 0), every way it can end in one line on stderr:

    - a LocalLeapError (any mistake the library reports) or an OSError -> `error: <message>`, EXIT_ERROR;
    - Ctrl-C, SIGTERM or SIGHUP -> `interrupted(why)`, EXIT_INTERRUPTED; `why` is "Ctrl-C", "SIGTERM" or
      "SIGHUP", and the line says what the command kept.

    A LostProcessError (another process of a multi-process run died) is left to the caller: that process must
    end through `processes.exit_lost`, without JAX's shutdown barrier. Anything else is a bug: its traceback
    shows."""
    _lift_startup_guard()  # from here on, Ctrl-C unwinds (and cleans up) as a KeyboardInterrupt
    try:
        with terminating_as_interrupt():
            status = work()
        return 0 if status is None else status
    except LostProcessError:
        raise
    except (LocalLeapError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        print(interrupted(str(e) or "Ctrl-C"), file=sys.stderr)
        return EXIT_INTERRUPTED
