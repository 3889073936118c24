"""What the GSM8K command lines (experiments/eval_gsm8k.py, experiments/sweep.py) share in how they read
flags (their --rules included) and how they end: a mistake in one `error: ...` line (status 2), Ctrl-C or
SIGTERM with what was kept (status 130)."""

from __future__ import annotations

import argparse
import math
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager

from localleap_jax.gsm8k.errors import UserError
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


@contextmanager
def termination_as_interrupt():
    """SIGTERM (a scheduler's kill, `timeout`) ends the run like Ctrl-C: what is done is kept."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_status(run: Callable[[], int], progress: Progress) -> int:
    """`run()`'s exit status, its mistakes and interruptions ended in one line: a UserError, or an OSError
    (the environment, not the code: a full disk, a vanished directory) -> `error: ...` and EXIT_ERROR;
    Ctrl-C or SIGTERM -> what `progress` kept, and EXIT_INTERRUPTED."""
    try:
        with termination_as_interrupt():
            return run()
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        progress.flush()
        print(progress.interrupted(str(e) or "Ctrl-C"), file=sys.stderr)
        return EXIT_INTERRUPTED
