"""What the GSM8K command lines (experiments/eval_gsm8k.py, experiments/sweep.py) share in how they read
flags (their --rules included) and how they end: a mistake in one `error: ...` line (status 2), Ctrl-C,
SIGTERM or SIGHUP with what was kept (status 130)."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sqlite3
import sys
from collections.abc import Callable
from contextlib import contextmanager

from localleap_jax.errors import UserError
from localleap_jax.gsm8k.progress import Progress
from localleap_jax.rules.sources import RulesError, load_rules

RULES_HELP = ("a Python file or module of your own rules (@ll.register(\"name\")), e.g. path/to/myrules.py or "
              "mypkg.rules; repeatable or comma-separated. Its names then work in --strategies like the built-in ones")

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a mistake in one `error: ...` line (its own prints the usage first)."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def whole_number(low: int, what: str):
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
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def seed(text: str) -> int:
    value = count(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer below 2**32, got {value}")
    return value


def load_user_rules(given: list[str] | None, flag: str = "--rules") -> list[str]:
    """The rule names --rules' files and modules register (rules.sources.load_rules); a mistake is one UserError
    line naming the flag. Nothing given: nothing loaded."""
    if not given:
        return []
    try:
        return load_rules(given)
    except RulesError as e:
        raise UserError(f"{flag} {e}") from None


TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextmanager
def termination_as_interrupt():
    """SIGTERM (a scheduler's kill, `timeout`) and SIGHUP (the terminal or session went away) end the run like
    Ctrl-C: what is done is kept."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    previous = {sig: signal.signal(sig, interrupt) for sig in TERMINATING}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def cache_errors_quiet():
    """lm-eval's response cache (sqlitedict) logs a failed write from its writer thread as dozens of traceback lines,
    then raises it in the next call: the run reports that once, in one line (`exit_status`)."""
    logs = [logging.getLogger(name) for name in ("sqlitedict", "sqlitedict.SqliteMultithread")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def cache_failure(e: sqlite3.Error, progress: Progress) -> str:
    """The one line for a response cache that cannot be written (a full disk, a damaged or read-only file)."""
    full = "full" in str(e).lower()
    fix = "free some space and " if full else ""
    what = "the disk is full: " if full else ""
    return (f"{what}lm-eval's response cache could not be written (sqlite3.{type(e).__name__}: {e}); "
            f"{progress.kept().replace('; rerun', f'; {fix}rerun')}")


def exit_status(run: Callable[[], int], progress: Progress) -> int:
    """`run()`'s exit status, its mistakes and interruptions ended in one line: a UserError, or an OSError
    (the environment, not the code: a full disk, a vanished directory), or lm-eval's response cache failing to
    write (sqlite3: a full disk) -> `error: ...` and EXIT_ERROR; Ctrl-C, SIGTERM or SIGHUP -> what `progress`
    kept, and EXIT_INTERRUPTED."""
    try:
        with termination_as_interrupt(), cache_errors_quiet():
            return run()
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except sqlite3.Error as e:  # lm-eval's response cache: what it committed before stays for the rerun
        progress.flush()
        print(f"error: {cache_failure(e, progress)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        progress.flush()
        print(progress.interrupted(str(e) or "Ctrl-C"), file=sys.stderr)
        return EXIT_INTERRUPTED
