"""The processes of one run: joining them, agreeing on a step's outcome, holding signals back, ending cleanly.

Every process of a multi-process run runs the same command. `initialize` joins them (jax.distributed,
before anything touches a JAX backend); `all_succeed` runs a step everywhere and makes every process raise
if any failed, so none is left waiting in the next collective; `signals_deferred` holds Ctrl-C/SIGTERM
around a step every process must take together; `exit_lost` ends a process whose peer died in one line.
Nothing here knows what the processes compute: the leader/follower protocol is `localleap_jax.dist.multihost`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from localleap_jax.errors import DistributedError, LostProcessError, first_line

EXIT_LOST = 2


# ---------------------------------------------------------------- joining the processes


@dataclasses.dataclass(frozen=True)
class Processes:
    """How this process joins a run: coordinator "HOST:PORT" (or "auto": JAX detects the cluster,
    e.g. a TPU pod or SLURM), the number of processes and this one's id; None: one process."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def joins(self) -> bool:
        return self.coordinator is not None


FLAGS = {"coordinator": "--coordinator", "num_processes": "--num-processes", "process_id": "--process-id"}


def processes_from(coordinator: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None, environ=os.environ, flags: dict[str, str] = FLAGS) -> Processes:
    """The run's processes from arguments, else the environment (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID); every mistake is a DistributedError naming the setting as
    `flags` calls it (a command line's flags by default)."""
    c, n, i = flags["coordinator"], flags["num_processes"], flags["process_id"]
    coordinator = coordinator or environ.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = num_processes if num_processes is not None else _env_int(environ, "JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int(environ, "JAX_PROCESS_ID")
    if coordinator is None:
        if num_processes is not None or process_id is not None:
            raise DistributedError(f"{n}/{i} need {c} HOST:PORT (the address of process 0; or "
                                   "JAX_COORDINATOR_ADDRESS)")
        return Processes()
    if coordinator == "auto":  # JAX reads the cluster's own environment
        return Processes("auto", num_processes, process_id)
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{c} {coordinator!r}: expected HOST:PORT (e.g. 10.0.0.1:8476), the address of "
                               "process 0")
    if num_processes is None or process_id is None:
        raise DistributedError(f"{c} needs {n} N and {i} I (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
    if num_processes < 1:
        raise DistributedError(f"{n} {num_processes}: expected a positive number")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"{i} {process_id}: expected 0 to {num_processes - 1} ({n} {num_processes})")
    return Processes(coordinator, num_processes, process_id)


def _env_int(environ, name: str) -> int | None:
    text = environ.get(name)
    if text is None or text == "":
        return None
    if not text.strip().isdigit():
        raise DistributedError(f"{name}={text!r}: expected a whole number")
    return int(text)


JOIN_TIMEOUT_ENV = "LOCALLEAP_JOIN_TIMEOUT"
DEFAULT_JOIN_TIMEOUT = 300.0  # seconds, JAX's own default initialization_timeout


def join_timeout(environ=os.environ) -> float:
    """How long a process waits for the others to join (LOCALLEAP_JOIN_TIMEOUT seconds; default 300)."""
    text = environ.get(JOIN_TIMEOUT_ENV)
    if text is None or not text.strip():
        return DEFAULT_JOIN_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise DistributedError(f"{JOIN_TIMEOUT_ENV}={text!r}: expected a number of seconds > 0")
    return value


def missing_line(processes: Processes, where: str, timeout: float) -> str:
    """What a process that waited `timeout` s to join says: who it was waiting for, and how to fix it."""
    n, i = processes.num_processes, processes.process_id
    hint = (f"start every process with the same command and its own --process-id, reaching {where}; "
            f"{JOIN_TIMEOUT_ENV}=SECONDS waits longer")
    if n is None or i is None:
        return f"the processes did not all join through {where} within {timeout:g} s; {hint}"
    if i == 0:
        missing = ("process 1, which never joined" if n == 2 else
                   f"processes 1 to {n - 1}, and not all of them joined")
        return f"process 0 waited {timeout:g} s at {where} for {missing} (--num-processes {n}); {hint}"
    return (f"process {i} of --num-processes {n} waited {timeout:g} s to join through {where}: process 0 (the "
            f"coordinator) or another process never came; {hint}")


def initialize(processes: Processes, timeout: float | None = None) -> None:
    """`jax.distributed.initialize` for `processes` (nothing for one process). Must come before anything
    touches a JAX backend. On CPU the processes' collectives go through gloo. A process still waiting for the others
    after `timeout` seconds (default: `join_timeout()`) ends in one line saying whom it waited for (`missing_line`),
    before JAX's own timeout, which aborts in a C++ check failure after minutes of silence."""
    if not processes.joins:
        return
    timeout = join_timeout() if timeout is None else timeout
    import jax

    from jax._src import xla_bridge  # the only way to ask "has a backend started" without starting one

    if xla_bridge.backends_are_initialized():
        raise DistributedError("the processes must be joined before JAX starts computing: call "
                               "localleap_jax.processes.initialize first thing")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # accelerators ignore this
    # The preemption service would only add warnings when a peer dies; nothing here uses it.
    jax.config.update("jax_enable_preemption_service", False)
    where = "JAX's cluster detection" if processes.coordinator == "auto" else processes.coordinator
    joined = threading.Event()

    def give_up():  # JAX's own timeout is later (below): this line comes first, then the process ends
        if not joined.is_set():
            exit_lost(missing_line(processes, where, timeout))

    watchdog = threading.Timer(timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    jax_timeout = int(timeout) + 60
    try:
        if processes.coordinator == "auto":
            jax.distributed.initialize(num_processes=processes.num_processes, process_id=processes.process_id,
                                       initialization_timeout=jax_timeout)
        else:
            jax.distributed.initialize(coordinator_address=processes.coordinator,
                                       num_processes=processes.num_processes, process_id=processes.process_id,
                                       initialization_timeout=jax_timeout)
    except (RuntimeError, ValueError) as e:  # a taken port, a bad address, ...
        raise DistributedError(f"could not join the run through {where}: {first_line(e)}") from None
    finally:
        joined.set()
        watchdog.cancel()


def is_multiprocess() -> bool:
    """Whether this process joined others (asks nothing of a JAX backend when it did not)."""
    import jax
    return jax.distributed.is_initialized() and jax.process_count() > 1


def is_follower() -> bool:
    """Whether this process follows process 0 (False for a lone process, without starting a backend)."""
    return is_multiprocess() and process_index() != 0


def process_index() -> int:
    import jax
    return jax.process_index()


def process_count() -> int:
    import jax
    return jax.process_count()


# ---------------------------------------------------------------- holding signals back


@contextmanager
def signals_deferred(signums=tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
                     ) -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends, then deliver them to the handlers that were there.

    Around a step every process must take together: interrupted halfway, the others would wait in
    a collective forever. (A signal only reaches Python between bytecodes, so a running program
    finishes first in any case.) Off the main thread, where handlers cannot be set, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


# ---------------------------------------------------------------- agreeing on a step's outcome


def all_succeed(step: Callable[[], Any], error: type[Exception], what: str):
    """Run `step` on every process; if it raises on any of them, raise on all of them (the failing
    process its own error, the others `error` naming it), once every process has finished it. So a
    step that fails on one host (a missing file) never leaves the others waiting in the next
    collective. One process: just `step()`."""
    if not is_multiprocess():
        return step()
    from jax.experimental import multihost_utils

    failure: Exception | None = None
    result = None
    try:
        result = step()
    except error as e:
        failure = e
    try:
        flags = np.asarray(multihost_utils.process_allgather(np.array([failure is not None], np.int32)))
    except Exception as e:  # noqa: BLE001  (a JaxRuntimeError: a process is gone)
        raise LostProcessError(f"lost contact with the other processes: one of them has died or cannot be "
                               f"reached ({first_line(e)})") from None
    if failure is not None:
        raise failure
    failed = np.flatnonzero(flags.reshape(-1)).tolist()
    if failed:
        raise error(f"{what} failed on process {', '.join(map(str, failed))} (its output says why)")
    return result


# ---------------------------------------------------------------- ending after a lost peer


def exit_lost(message: str, status: int = EXIT_LOST) -> None:
    """End this process now with one `error: ...` line: after a peer died, JAX's shutdown barrier (run
    at a normal exit) would wait for the dead one, and its coordination client would then abort with
    pages of log. stderr is closed first, so nothing JAX prints meanwhile follows the line."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    line = f"error: {message}\n".encode()
    try:
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # JAX's own threads write to fd 2
        os.write(saved, line)
    except OSError:
        pass
    os._exit(status)


__all__ = ["DEFAULT_JOIN_TIMEOUT", "DistributedError", "EXIT_LOST", "FLAGS", "JOIN_TIMEOUT_ENV", "LostProcessError",
           "Processes", "all_succeed", "exit_lost", "initialize", "is_follower", "is_multiprocess", "join_timeout",
           "missing_line", "process_count", "process_index", "processes_from", "signals_deferred"]
