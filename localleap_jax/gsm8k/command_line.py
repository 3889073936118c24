"""What the GSM8K command lines (eval_gsm8k, sweep) add to the toolkit (`localleap_jax.cli`): their --rules, and
how they end: `cli.run_command` with what a run keeps (`Progress`), and lm-eval's response cache failing to write
reported in one line."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from contextlib import contextmanager

from localleap_jax import cli
from localleap_jax.errors import UserError
from localleap_jax.gsm8k.progress import Progress
from localleap_jax.rules.sources import RulesError, load_rules

RULES_HELP = ("a Python file or module of your own rules (@ll.register(\"name\")), e.g. path/to/myrules.py or "
              "mypkg.rules; repeatable or comma-separated. Its names then work in --strategies like the built-in ones")


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
    """`run()`'s exit status through `cli.run_command` (a mistake or an OSError: one `error: ...` line, EXIT_ERROR;
    Ctrl-C, SIGTERM or SIGHUP: what `progress` kept, EXIT_INTERRUPTED), and lm-eval's response cache failing to
    write (sqlite3: a full disk) said in one line too, with what it kept."""
    def guarded() -> int:
        try:
            with cache_errors_quiet():
                return run()
        except sqlite3.Error as e:  # lm-eval's response cache: what it committed before stays for the rerun
            progress.flush()
            raise UserError(cache_failure(e, progress)) from None

    def interrupted(why: str) -> str:
        progress.flush()
        return progress.interrupted(why)

    return cli.run_command(guarded, interrupted)
