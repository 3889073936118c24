"""Several processes, one run: process 0 leads, every other process follows.

Every process runs the same command. `initialize` joins them (jax.distributed, before anything
touches a JAX backend). Process 0, the leader, does all the work that is not generation: it reads
the data, runs lm-eval, writes every file. The followers run no lm-eval and write nothing: they
wait for the leader's messages and carry out each one, so that every collective program (the
checkpoint restore, each sharded `generate`) runs on every process at once, on the same inputs:

    leader (process 0)                        follower (process i > 0)
    leader().load(path, dtype, mesh)    ->    load(path, dtype, mesh=mesh)
    leader().generate(model, ids, ...)  ->    generate(model, ids, ..., mesh=mesh)   (output dropped)
    leader().stop(status)               ->    follow() returns status

A message is broadcast from process 0 with `multihost_utils.broadcast_one_to_all` in two parts: a
fixed-size header (kind, shapes, lengths) and then the arrays it announces (prompt ids and mask,
the request as JSON, the random key's data). The DecodeConfig travels as JSON with the rule's
settings as exact numbers (per-row arrays included); a rule spec string would round floats to six
digits (`rule.spec()` formats with %g).

A leader sends the message and runs its own call with SIGINT/SIGTERM held back (`signals_deferred`):
a Ctrl-C between the two would leave the followers inside a program the leader never joins.
Whatever ends the leader's run (its end, an error, Ctrl-C) sends "stop"; callers do that with
`leading()`. A process that dies is noticed by the others' next collective (the connection
closes) or, for a host that vanishes, by JAX's heartbeat (100 s); the survivor says so in one line
and exits (status 2) without waiting for JAX's shutdown barrier, which would wait for the dead.
When process 0 itself dies, JAX's own runtime in each follower may get there first and end the
process with its message "Terminating process because the JAX distributed service detected fatal
errors" (JAX offers no hook to replace it): either way, no follower waits forever.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from localleap_jax.rules import DecodeError

MAGIC = 0x4C4C4D48  # "LLMH": a follower running another version of this protocol stops at once
KINDS = ("stop", "load", "generate")
HEADER_WORDS = 8  # magic, kind, rows, cols, json bytes, key words, status, reserved
JSON_QUANTUM = 512  # JSON is padded to a multiple of this: fewer distinct broadcast shapes to compile
EXIT_LOST = 2


class DistributedError(ValueError):
    """The processes cannot be set up as asked (flags, environment, a coordinator that never answered)."""


class LostProcessError(RuntimeError):
    """Another process of the run died or stopped answering in the middle of a collective."""


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


def initialize(processes: Processes) -> None:
    """`jax.distributed.initialize` for `processes` (nothing for one process). Must come before anything
    touches a JAX backend. On CPU the processes' collectives go through gloo."""
    if not processes.joins:
        return
    import jax

    from jax._src import xla_bridge  # the only way to ask "has a backend started" without starting one

    if xla_bridge.backends_are_initialized():
        raise DistributedError("the processes must be joined before JAX starts computing: call "
                               "localleap_jax.multihost.initialize first thing")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # accelerators ignore this
    # The preemption service would only add warnings when a peer dies; nothing here uses it.
    jax.config.update("jax_enable_preemption_service", False)
    where = "JAX's cluster detection" if processes.coordinator == "auto" else processes.coordinator
    try:
        if processes.coordinator == "auto":
            jax.distributed.initialize(num_processes=processes.num_processes, process_id=processes.process_id)
        else:
            jax.distributed.initialize(coordinator_address=processes.coordinator,
                                       num_processes=processes.num_processes, process_id=processes.process_id)
    except (RuntimeError, ValueError) as e:  # unreachable coordinator (after JAX's 300 s), a taken port, ...
        raise DistributedError(f"could not join the run through {where}: {_first_line(e)}") from None


def is_multiprocess() -> bool:
    """Whether this process joined others (asks nothing of a JAX backend when it did not)."""
    import jax
    return jax.distributed.is_initialized() and jax.process_count() > 1


def mesh_for_run(text: str | None):
    """The mesh a run generates on: `text` (data=D,model=M) over every device of every process; model=1
    for several processes given none; None for a lone process given none (the pmap path). A mistake in
    `text` is a DecodeError."""
    from localleap_jax.sharding import mesh_from_text

    if text is None:
        if not is_multiprocess():
            return None
        text = "model=1"
    return mesh_from_text(text)


def is_follower() -> bool:
    """Whether this process follows process 0 (False for a lone process, without starting a backend)."""
    return is_multiprocess() and process_index() != 0


def process_index() -> int:
    import jax
    return jax.process_index()


def process_count() -> int:
    import jax
    return jax.process_count()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------- holding signals back


@contextmanager
def signals_deferred(signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then deliver them to the handlers that were there.

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


# ---------------------------------------------------------------- a DecodeConfig as JSON


def _json_value(value):
    """A setting as JSON: a number as itself (Python's float repr round-trips exactly), an array of one
    value per row as {"rows": [...], "dtype": ...}."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr.item()
    return {"rows": arr.tolist(), "dtype": arr.dtype.name}


def _from_json_value(value):
    if isinstance(value, dict):
        return np.asarray(value["rows"], dtype=value["dtype"])
    return value


def rule_to_json(rule) -> dict:
    """A rule object as JSON: a registered rule by name with every field's exact value, or a combinator
    of such rules. A rule that only exists as a Python object here (a function, an unregistered class)
    cannot be rebuilt by another process: DecodeError."""
    from localleap_jax.rules import RULES, AllOf, AnyOf

    if isinstance(rule, AnyOf):  # AllOf is an AnyOf
        return {"combinator": "all_of" if isinstance(rule, AllOf) else "any_of",
                "rules": [rule_to_json(r) for r in rule.rules]}
    name = getattr(rule, "name", None)
    if not dataclasses.is_dataclass(rule) or RULES.get(name) is not type(rule):
        raise DecodeError(f"rule {name or rule!r} cannot be sent to the other processes: a multi-process run "
                          "takes registered rules (ll.register) and any_of/all_of of them")
    return {"rule": name, "fields": {f.name: _json_value(getattr(rule, f.name)) for f in dataclasses.fields(rule)}}


def rule_from_json(data: dict):
    from localleap_jax.rules import RULES, all_of, any_of

    if "combinator" in data:
        combine = {"any_of": any_of, "all_of": all_of}[data["combinator"]]
        return combine(*(rule_from_json(r) for r in data["rules"]))
    return RULES[data["rule"]](**{k: _from_json_value(v) for k, v in data["fields"].items()})


def config_to_json(cfg) -> dict:
    """Everything of a DecodeConfig, the rule resolved (names and the deprecated fields folded in)."""
    from localleap_jax.decode import _LEGACY_SETTINGS

    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.name not in ("strategy", *_LEGACY_SETTINGS)}
    return {**{k: _json_value(v) for k, v in fields.items()}, "rule": rule_to_json(cfg.rule)}


def config_from_json(data: dict):
    from localleap_jax.decode import DecodeConfig

    fields = {k: v for k, v in data.items() if k != "rule"}
    return DecodeConfig(strategy=rule_from_json(data["rule"]), **fields)


# ---------------------------------------------------------------- messages


@dataclasses.dataclass
class Message:
    """What the leader asks of the followers. `meta` is JSON: load: path, dtype, mesh, verify;
    generate: config, trace, key_impl; stop: nothing (the status travels in the header)."""

    kind: str
    meta: dict = dataclasses.field(default_factory=dict)
    ids: np.ndarray | None = None  # [B, P] int32
    mask: np.ndarray | None = None  # [B, P] bool
    key: np.ndarray | None = None  # the random key's data, uint32
    status: int = 0  # stop: the leader's exit status


def pack(msg: Message) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(header int32[HEADER_WORDS], the arrays it announces) for one message."""
    text = json.dumps(msg.meta, sort_keys=True).encode() if msg.meta else b""
    rows, cols = msg.ids.shape if msg.ids is not None else (0, 0)
    key = None if msg.key is None else np.asarray(msg.key, np.uint32).reshape(-1)
    header = np.array([MAGIC, KINDS.index(msg.kind), rows, cols, len(text), 0 if key is None else key.size,
                       msg.status, 0], np.int32)
    payload = {}
    if text:
        padded = -(-len(text) // JSON_QUANTUM) * JSON_QUANTUM
        payload["json"] = np.frombuffer(text.ljust(padded, b" "), np.uint8).copy()
    if rows:
        payload["ids"] = np.asarray(msg.ids, np.int32)
        payload["mask"] = np.asarray(msg.mask, bool).astype(np.uint8)
    if key is not None:
        payload["key"] = key
    return header, payload


def payload_template(header: np.ndarray) -> dict[str, np.ndarray]:
    """Zero arrays of the shapes a header announces (what a follower passes to the broadcast)."""
    check_header(header)
    _, _, rows, cols, n_json, n_key, _, _ = (int(v) for v in header)
    payload = {}
    if n_json:
        payload["json"] = np.zeros(-(-n_json // JSON_QUANTUM) * JSON_QUANTUM, np.uint8)
    if rows:
        payload["ids"] = np.zeros((rows, cols), np.int32)
        payload["mask"] = np.zeros((rows, cols), np.uint8)
    if n_key:
        payload["key"] = np.zeros(n_key, np.uint32)
    return payload


def check_header(header: np.ndarray) -> None:
    header = np.asarray(header)
    if header.shape != (HEADER_WORDS,) or int(header[0]) != MAGIC or not 0 <= int(header[1]) < len(KINDS):
        raise LostProcessError("process 0 sent a message this process cannot read (are all processes running "
                               "the same version of localleap_jax?)")


def unpack(header: np.ndarray, payload: dict[str, np.ndarray]) -> Message:
    check_header(header)
    _, kind, rows, _, n_json, _, status, _ = (int(v) for v in header)
    meta = json.loads(bytes(np.asarray(payload["json"], np.uint8))[:n_json]) if n_json else {}
    return Message(KINDS[kind], meta, ids=payload["ids"] if rows else None,
                   mask=payload["mask"].astype(bool) if rows else None, key=payload.get("key"), status=status)


# ---------------------------------------------------------------- transports


class Transport(Protocol):
    """Carries a pytree of host arrays from process 0 to every process (shapes known to all)."""

    def send(self, tree: Any) -> None: ...

    def receive(self, template: Any) -> Any: ...


class BroadcastTransport:
    """`multihost_utils.broadcast_one_to_all`: a psum over every device of every process, in which
    only process 0 contributes (gloo on CPU, NCCL/ICI on accelerators)."""

    def send(self, tree):
        self._broadcast(tree, True)

    def receive(self, template):
        return self._broadcast(template, False)

    @staticmethod
    def _broadcast(tree, is_source: bool):
        import jax
        from jax.experimental import multihost_utils

        try:
            return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)
        except jax.errors.JaxRuntimeError as e:
            raise LostProcessError(f"lost contact with the other processes: one of them has died or cannot be "
                                  f"reached ({_first_line(e)})") from None


def send(transport: Transport, msg: Message) -> None:
    header, payload = pack(msg)
    transport.send(header)
    if payload:
        transport.send(payload)


def receive(transport: Transport) -> Message:
    header = np.asarray(transport.receive(np.zeros(HEADER_WORDS, np.int32)))
    template = payload_template(header)
    payload = transport.receive(template) if template else {}
    return unpack(header, {k: np.asarray(v) for k, v in payload.items()})


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
                                  f"reached ({_first_line(e)})") from None
    if failure is not None:
        raise failure
    failed = np.flatnonzero(flags.reshape(-1)).tolist()
    if failed:
        raise error(f"{what} failed on process {', '.join(map(str, failed))} (its output says why)")
    return result


# ---------------------------------------------------------------- the leader


class Leader:
    """Process 0's side of the run: each call is sent to the followers, then made here.

    With no transport (one process) the calls are made here only."""

    def __init__(self, transport: Transport | None = None):
        self.transport = transport
        self.stopped = False

    @property
    def has_followers(self) -> bool:
        return self.transport is not None

    def load(self, path, dtype="bfloat16", mesh=None, verify: bool = True):
        """`localleap_jax.load` on every process (the checkpoint must be at `path` on each host)."""
        from localleap_jax.checkpoint import load, parameter_dtype

        path = Path(path).expanduser().resolve()
        meta = {"path": str(path), "dtype": parameter_dtype(dtype).name, "verify": bool(verify),
                "mesh": None if mesh is None else mesh_shape(mesh)}
        with signals_deferred():
            self._send(Message("load", meta))
            return self._collective(lambda: load(path, dtype=dtype, verify=verify, mesh=mesh))

    def generate(self, model, ids, mask=None, cfg=None, rng=None, *, mesh=None, trace: bool = False):
        """`localleap_jax.generate(..., mesh=mesh)` on every process, on the same inputs (the followers
        drop their copy of the output). Inputs are checked here first, so a mistake never reaches them."""
        from localleap_jax.decode import DecodeConfig, generate, prepare_inputs

        cfg = DecodeConfig() if cfg is None else cfg
        if not self.has_followers:
            return generate(model, ids, mask, cfg, rng, trace=trace, mesh=mesh)
        if mesh is None:
            raise DecodeError("a multi-process run generates on a mesh: pass mesh=make_mesh(...)")
        ids = np.asarray(ids)
        mask = np.ones(ids.shape, bool) if mask is None else np.asarray(mask)
        prepare_inputs(ids, mask, cfg, model.config, rng)  # raises what generate would, before anything is sent
        meta = {"config": config_to_json(cfg), "trace": bool(trace), "key_impl": None, "mesh": mesh_shape(mesh)}
        key = None
        if rng is not None:
            import jax
            meta["key_impl"] = str(jax.random.key_impl(rng))
            key = np.asarray(jax.random.key_data(rng))
        with signals_deferred():
            self._send(Message("generate", meta, ids=ids, mask=mask, key=key))
            return self._collective(lambda: generate(model, ids, mask, cfg, rng, trace=trace, mesh=mesh))

    def stop(self, status: int = 0) -> None:
        """Release the followers (once; later calls do nothing). `status` becomes their exit status."""
        if self.stopped or not self.has_followers:
            return
        self.stopped = True
        with signals_deferred():
            send(self.transport, Message("stop", status=int(status)))

    def _send(self, msg: Message) -> None:
        if not self.has_followers:
            return
        if self.stopped:
            raise LostProcessError("the followers were already released (stop was sent)")
        send(self.transport, msg)

    def _collective(self, call: Callable[[], Any]):
        if not self.has_followers:
            return call()
        import jax
        try:
            return call()
        except jax.errors.JaxRuntimeError as e:
            raise LostProcessError(f"a collective step failed; another process has probably died "
                                   f"({_first_line(e)})") from None


def mesh_shape(mesh) -> list[int]:
    """[data, model] of a mesh, which the followers rebuild with make_mesh: so it must be make_mesh's."""
    from localleap_jax.sharding import make_mesh

    shape = [int(mesh.shape["data"]), int(mesh.shape["model"])]
    if mesh != make_mesh(*shape):
        raise DecodeError(f"a multi-process run needs the mesh make_mesh(data={shape[0]}, model={shape[1]}) builds "
                          "(the other processes rebuild it that way); this one orders its devices otherwise")
    return shape


_LEADER: Leader | None = None


def leader() -> Leader:
    """This process's Leader (process 0 of a multi-process run, or the only process)."""
    global _LEADER
    if _LEADER is None:
        if is_follower():
            raise LostProcessError(f"process {process_index()} is a follower; only process 0 leads the run")
        _LEADER = Leader(BroadcastTransport() if is_multiprocess() else None)
    return _LEADER


@contextmanager
def leading() -> Iterator[Leader]:
    """The leader, for a block that releases the followers however it ends: `lead.stop(status)`
    inside the block sets their exit status; otherwise they get 0 when the block ends normally, 130
    after Ctrl-C and 2 after an error. After a lost process nobody is left to release."""
    lead = leader()
    status = 0
    try:
        yield lead
    except KeyboardInterrupt:
        status = 130
        raise
    except LostProcessError:
        lead.stopped = True  # the transport is broken: sending would fail or hang
        raise
    except BaseException:
        status = 2
        raise
    finally:
        try:
            lead.stop(status)
        except LostProcessError:
            pass  # a follower is gone: nothing left to release


# ---------------------------------------------------------------- the followers


@dataclasses.dataclass
class Follower:
    """A follower's state between messages: the model it loaded and the mesh it lives on."""

    model: Any = None
    mesh: Any = None
    generated: int = 0  # generate messages carried out
    last: Any = None  # the last Generation (the leader has the same; kept for checks, not used)

    def handle(self, msg: Message) -> None:
        if msg.kind == "load":
            self.load(msg.meta)
        elif msg.kind == "generate":
            self.generate(msg)

    def load(self, meta: dict) -> None:
        from localleap_jax.checkpoint import CheckpointError, load
        from localleap_jax.sharding import make_mesh

        self.model = None
        self.mesh = None if meta["mesh"] is None else make_mesh(*meta["mesh"])
        try:
            self.model = load(meta["path"], dtype=meta["dtype"], verify=meta["verify"], mesh=self.mesh)
        except CheckpointError as e:  # every process raised (checkpoint.load agrees): the leader sends stop
            print(f"error: process {process_index()}: {e}", file=sys.stderr, flush=True)

    def generate(self, msg: Message) -> None:
        from localleap_jax.decode import generate

        if self.model is None:
            raise LostProcessError("process 0 asked for a generation before any model was loaded here")
        if self.mesh is None or list(msg.meta["mesh"]) != mesh_shape(self.mesh):
            raise LostProcessError(f"process 0 generates on mesh {msg.meta['mesh']}, this process loaded the model "
                                   f"on {None if self.mesh is None else dict(self.mesh.shape)}")
        rng = None
        if msg.key is not None:
            import jax
            rng = jax.random.wrap_key_data(msg.key, impl=msg.meta["key_impl"])
        self.last = generate(self.model, msg.ids, msg.mask, config_from_json(msg.meta["config"]), rng,
                             trace=msg.meta["trace"], mesh=self.mesh)
        self.generated += 1


def follow(transport: Transport | None = None, follower: Follower | None = None) -> int:
    """A follower's whole run: carry out the leader's messages until "stop"; returns the leader's status.

    Raises LostProcessError when the leader is gone (see `exit_lost`)."""
    transport = transport or BroadcastTransport()
    follower = follower or Follower()
    while True:
        msg = receive(transport)
        if msg.kind == "stop":
            return msg.status
        follower.handle(msg)


def follow_until_stopped(what: str = "run") -> int:
    """A command line's follower: `follow()`, with Ctrl-C held for the leader (the first one only
    says so; a second one quits) and a lost leader ended in one line. Returns the exit status."""
    def second_interrupt(signum, frame):
        print(f"interrupted: process {process_index()} left the {what}", file=sys.stderr, flush=True)
        os._exit(130)

    def first_interrupt(signum, frame):
        print(f"note: process {process_index()} follows process 0, which ends the {what}; Ctrl-C again to "
              "quit now", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, second_interrupt)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, first_interrupt)
    try:
        status = follow()
    except LostProcessError as e:
        exit_lost(f"process {process_index()}: {e}")
    except Exception as e:  # noqa: BLE001  (this process cannot go on: its end tells process 0)
        exit_lost(f"process {process_index()}: {type(e).__name__}: {_first_line(e)}")
    if status:
        print(f"stopped: process 0 ended the {what} with exit status {status} (its output says why)",
              file=sys.stderr, flush=True)
    return status


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


__all__ = ["BroadcastTransport", "DistributedError", "Follower", "Leader", "LostProcessError", "Message",
           "Processes", "all_succeed", "config_from_json", "config_to_json", "exit_lost", "follow",
           "follow_until_stopped", "initialize", "is_follower", "is_multiprocess", "mesh_for_run", "leader", "leading", "pack", "processes_from", "receive",
           "rule_from_json", "rule_to_json", "send", "signals_deferred", "unpack"]
