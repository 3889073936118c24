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
away): within seconds, even while JAX compiles or runs a program (the program's watchdog; see "signals" below),
and never a crash. A Ctrl-C while a command is still importing its heavy modules (`guard_startup`) ends it in one
line too. Work made of steps (batches, chunks, training steps) stops between two (`stopping_between_steps`), so a
finished step is kept. An output directory that cannot be written is found before any work (`check_writable_dir`).

A leaf: it imports nothing of the package but `errors`, so it costs nothing to import before anything heavy.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import threading
import time
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


# The parameter dtypes a command's --dtype takes (float16 is not one: XLA's CPU backend cannot run it, and no
# released model here is float16), refused at parse time like any other bad flag.
DTYPES = ("auto", "bfloat16", "float32")
DTYPE_HELP = "parameter dtype: auto (the default: float32 on CPU, bfloat16 on GPU/TPU), bfloat16, float32"


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
#
# How a command answers Ctrl-C (SIGTERM and SIGHUP alike), wherever it is:
#
# - While it imports its heavy modules (`guard_startup`): one line, exit 130, at once.
# - While it works (`run_command`): the signal raises KeyboardInterrupt in the main thread, so the work unwinds and
#   keeps what is done; inside `stopping_between_steps()` it only asks the work to stop, and the work stops at its
#   next `stop_if_asked()`, between two steps (a batch generated and cached, a training step), so no finished step
#   is thrown away.
# - Python runs a signal's handler only between two bytecodes of the main thread: not while JAX compiles or runs a
#   program (that can take minutes), and a KeyboardInterrupt raised inside a garbage-collector callback or a
#   finalizer is printed as "Exception ignored" and lost (JAX registers both). So the program's process (a command
#   started through `guard_startup`) also has a watchdog thread, told of every signal by the interpreter's wakeup
#   file descriptor: if the work has neither stopped nor started unwinding GRACE_S seconds after a signal, the
#   watchdog ends the program itself, first running what the work asked for (`if_abandoned`: commit a response
#   cache, release an output directory's lock, remove an output that holds nothing), then printing the command's
#   one interrupted line, and exiting with status 130. A section that holds the signals itself (a lockstep step of
#   a multi-process run, an Orbax write: they put their own handler in place) is waited for.
# - The program's process ends after an interrupt without the interpreter's teardown (os._exit, once its output
#   is flushed): tearing JAX down after an interrupted compile can crash (a segmentation fault after the line).

GRACE_S = 2.0  # how long the watchdog lets the work take to stop at a step or start unwinding after a signal
LINE_S = 10.0  # how long it waits for the command's interrupted line (which may commit a response cache first)


def _interrupted_while_starting(signum, frame):
    # os._exit, not an exception: unwinding out of a half-imported C extension can crash the interpreter.
    print("error: interrupted before anything was written", file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)


def guard_startup() -> None:
    """Call first thing in a command's `__main__`, before its heavy imports (JAX, lm-eval, transformers: seconds):
    a Ctrl-C, SIGTERM or SIGHUP meanwhile ends the process in one line (exit 130) instead of a traceback from
    inside an import. `run_command` lifts the guard when the command's work starts. Signals someone else
    already handles are left alone. It also marks this process as the command's own: `run_command` then answers
    a signal within GRACE_S seconds whatever the work is doing (its watchdog), and ends the process after an
    interrupt without the interpreter's teardown."""
    _STATE.program = True
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    for sig in TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _interrupted_while_starting)


def _signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class _Interrupts:
    """The signals of the command running in this process (one at a time): what came, and how the work answers."""

    def __init__(self):
        self.lock = threading.RLock()
        self.program = False  # this process is a command started through guard_startup
        self.reset()

    def reset(self) -> None:
        self.arrived: float | None = None  # when the first signal came (time.monotonic)
        self.why: str | None = None  # "Ctrl-C", "SIGTERM" or "SIGHUP"
        self.unwinding = False  # a KeyboardInterrupt was raised in the main thread and not lost since
        self.stepwise = 0  # depth of stopping_between_steps()
        self.ending = False  # the command is ending (its own way or the watchdog's): nothing else may end it
        self.abandoned = False  # the watchdog is ending it
        self.cleanups: dict[int, Callable[[], None]] = {}

    def arrive(self, signum: int) -> None:
        with self.lock:
            if self.arrived is None:
                self.arrived, self.why = time.monotonic(), _signal_name(signum)

    def handler(self, signum, frame) -> None:
        self.arrive(signum)
        if self.stepwise:  # the work stops at its next stop_if_asked()
            return
        self.raise_interrupt()

    def raise_interrupt(self) -> None:
        self.unwinding = True
        raise KeyboardInterrupt() if self.why == "Ctrl-C" else KeyboardInterrupt(self.why)


_STATE = _Interrupts()


def _on_signal(signum, frame) -> None:
    """The handler of SIGINT, SIGTERM and SIGHUP while a command works."""
    _STATE.handler(signum, frame)


@contextmanager
def stopping_between_steps() -> Iterator[None]:
    """Inside the block a signal only asks the work to stop: it stops (raises KeyboardInterrupt) at its next
    `stop_if_asked()`, so a step half done is finished and kept rather than thrown away. A signal that came before
    the block raises on entry. Where no command runs (a library caller), it does nothing."""
    with _STATE.lock:
        _STATE.stepwise += 1
    try:
        stop_if_asked()
        yield
    finally:
        with _STATE.lock:
            _STATE.stepwise -= 1
    stop_if_asked()  # a signal that came during the last step


def stop_if_asked() -> None:
    """Between two steps of the work: raise KeyboardInterrupt if a signal asked the command to stop."""
    if _STATE.why is not None and not _STATE.unwinding:
        _STATE.raise_interrupt()


@contextmanager
def if_abandoned(cleanup: Callable[[], None]) -> Iterator[None]:
    """While the block runs, `cleanup` runs if the watchdog ends the program (on the watchdog's thread, before the
    interrupted line): what the block's own unwinding would do that must not be skipped (commit a cache, release a
    lock, remove an output that holds nothing). It must be safe to run while the work is stuck in a compiled call,
    and beside the block's own cleanup (make both run at most once)."""
    token = abandon_cleanup(cleanup)
    try:
        yield
    finally:
        with _STATE.lock:
            _STATE.cleanups.pop(token, None)


def abandon_cleanup(cleanup: Callable[[], None]) -> int:
    """`if_abandoned` for the rest of the command (a response cache opened by a library): returns its token."""
    with _STATE.lock:
        token = id(cleanup) ^ len(_STATE.cleanups) << 48
        _STATE.cleanups[token] = cleanup
    return token


def _lost_interrupts(unraisable) -> None:
    """sys.unraisablehook: a KeyboardInterrupt raised inside a finalizer or a garbage-collector callback is lost
    (printed as "Exception ignored in ..."); the work did not start unwinding, so the watchdog ends the program."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        _STATE.unwinding = False
        return  # not printed: the interrupted line says what happened
    _PREVIOUS_UNRAISABLEHOOK(unraisable)


_PREVIOUS_UNRAISABLEHOOK = sys.unraisablehook


def _distributed() -> bool:
    """Whether this process joined a multi-process run (then a signal is answered between the lockstep steps, as
    before: ending one process alone would leave the others waiting, and JAX's shutdown barrier needs it)."""
    jax = sys.modules.get("jax")
    try:
        return jax is not None and jax.distributed.is_initialized()
    except Exception:  # noqa: BLE001
        return False


class _Watchdog:
    """The program's watchdog (see the notes above): a thread woken by the interpreter's wakeup fd on every signal."""

    def __init__(self, interrupted: Callable[[str], str]):
        self.interrupted = interrupted
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self.write_fd = write_fd
        self.previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="interrupt-watchdog", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.done.set()
        signal.set_wakeup_fd(self.previous_fd)
        os.write(self.write_fd, b"\0")  # wakes the thread
        self.thread.join(timeout=1.0)
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)

    def watch(self) -> None:
        import select

        while not self.done.is_set():
            ready, _, _ = select.select([self.read_fd], [], [], 0.05)
            if ready:
                for signum in os.read(self.read_fd, 512):
                    if signum in _HANDLED and not self.done.is_set():
                        _STATE.arrive(signum)
            if _STATE.arrived is None or self.done.is_set():
                continue
            if self.held():  # the grace starts when the section lets the signal through
                _STATE.arrived = time.monotonic()
                continue
            if _STATE.unwinding or _distributed():
                continue
            if time.monotonic() - _STATE.arrived >= GRACE_S:
                self.abandon()

    @staticmethod
    def held() -> bool:
        """A section holds the signals itself (its own handler is in place): wait for it."""
        return any(signal.getsignal(s) is not _on_signal for s in _HANDLED)

    def abandon(self) -> None:
        with _STATE.lock:
            if _STATE.ending:
                return
            _STATE.ending = _STATE.abandoned = True
            cleanups = list(_STATE.cleanups.values())[::-1]
        for cleanup in [*cleanups, _close_progress_bars]:
            try:
                cleanup()
            except Exception:  # noqa: BLE001  (ending anyway; the line below says what was kept)
                pass
        why, said = _STATE.why or "Ctrl-C", []
        # The line may commit a cache first (a writer thread): bounded, so a stuck writer never stops the exit.
        def tell() -> None:
            try:
                said.append(self.interrupted(why))
            except Exception:  # noqa: BLE001  (the plain line below)
                pass

        teller = threading.Thread(target=tell, daemon=True)
        teller.start()
        teller.join(timeout=LINE_S)
        _exit_now(said[0] if said else _interrupted(why))


_HANDLED = (signal.SIGINT, *TERMINATING)


def _close_progress_bars() -> None:
    """Close the progress bars still open (the work's own `finally` never runs): the line starts a line of its own."""
    tqdm = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def _exit_now(line: str | None) -> None:
    """End the program: `line` on stderr, the output flushed, exit status 130, no interpreter teardown."""
    try:
        if line:
            print(line, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    os._exit(EXIT_INTERRUPTED)


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
      "SIGHUP", and the line says what the command kept. In the program's own process (`guard_startup`) this is
      within GRACE_S seconds of the signal whatever the work is doing, and the process ends here (see the notes
      on signals above).

    A LostProcessError (another process of a multi-process run died) is left to the caller: that process must
    end through `processes.exit_lost`, without JAX's shutdown barrier. Anything else is a bug: its traceback
    shows."""
    main_thread = threading.current_thread() is threading.main_thread()
    _STATE.reset()
    previous = {}
    if main_thread:  # from here on, a signal unwinds the work (and cleans up) as a KeyboardInterrupt
        previous = {sig: signal.signal(sig, _on_signal) for sig in _HANDLED}
        sys.unraisablehook = _lost_interrupts
    watchdog = _Watchdog(interrupted) if main_thread and _STATE.program else None
    status, line = None, None
    try:
        try:
            status = work()
            status = 0 if status is None else status
        except LostProcessError:
            raise
        except (LocalLeapError, OSError) as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            status = EXIT_ERROR
        except KeyboardInterrupt as e:
            _end_here()
            line = interrupted(str(e) or "Ctrl-C")
            status = EXIT_INTERRUPTED
    finally:
        _end_here()
        if watchdog is not None:
            watchdog.close()
        if main_thread:
            sys.unraisablehook = _PREVIOUS_UNRAISABLEHOOK
            for sig, handler in previous.items():
                signal.signal(sig, _restored(sig, handler))
        program = _STATE.program
        _STATE.reset()  # what came is answered: code that runs after the command (a caller's) starts afresh
    if status == EXIT_INTERRUPTED and line is not None:
        if program and not _distributed():
            _exit_now(line)
        print(line, file=sys.stderr)
    return status


def _end_here() -> None:
    """The command ends on this thread: from now on the watchdog leaves it alone; if the watchdog is already ending
    the program, wait for it (it exits the process)."""
    with _STATE.lock:
        theirs = _STATE.ending and _STATE.abandoned
        _STATE.ending = True
    if theirs:
        threading.Event().wait()


def _restored(sig: int, handler):
    """The handler to put back: the startup guard is lifted (the default), whatever else was there stays."""
    if handler is _interrupted_while_starting or handler is None:
        return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
    return handler
