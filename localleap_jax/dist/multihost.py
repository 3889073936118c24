"""Several processes, one run: process 0 leads, every other process follows.

Every process runs the same command. `processes.initialize` joins them (jax.distributed, before anything
touches a JAX backend). Process 0, the leader, does all the work that is not generation: it reads
the data, runs lm-eval, writes every file. The followers run no lm-eval and write nothing: they
wait for the leader's messages and carry out each one, so that every collective program (the
checkpoint restore, each sharded `generate`) runs on every process at once, on the same inputs:

    leader (process 0)                        follower (process i > 0)
    leader().load(path, dtype, mesh)    ->    load(path, dtype, mesh=mesh)
    leader().generate(model, ids, ...)  ->    _generate(model, ids, ..., mesh=mesh)   (output dropped)
    leader().loglikelihood(model, ...)  ->    the same estimates on the mesh         (output dropped)
    leader().stop(status)               ->    follow() returns status

Messages and their transport are in `localleap_jax.dist.messages`.

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
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from localleap_jax import checkpoint, cli
from localleap_jax.decode import DecodeConfig, prepare_inputs, run
from localleap_jax.decode.config import prompt_arrays
from localleap_jax.decode.run import check_slots
from localleap_jax.dist.messages import BroadcastTransport, Message, Transport, receive, send
from localleap_jax.dist.placement import decode_placement, likelihood_placement
from localleap_jax.errors import CheckpointError, DecodeError, first_line
from localleap_jax.likelihood import LikelihoodConfig, check_requests, greedy_match
from localleap_jax.likelihood import loglikelihood as loglikelihood_on
from localleap_jax.tokenizer import left_pad
from localleap_jax.partition import make_mesh, mesh_from_text
from localleap_jax.processes import (LostProcessError, all_succeed, exit_lost, is_follower, is_multiprocess,
                                     process_index, signals_deferred)
from localleap_jax.rules.sources import RulesError, ensure_sources, sources_of


def _load(path, dtype="bfloat16", verify: bool = True, mesh=None) -> checkpoint.Model:
    """This process's part of a load: `checkpoint.load` with every step agreed by every process (if any process
    cannot load, a missing or damaged file on one host, every process raises CheckpointError, so none is left
    waiting for the others). The checkpoint must be at `path` on every host."""
    return checkpoint.load(path, dtype, verify, mesh, agree=lambda step, what: all_succeed(step, CheckpointError, what))


def _generate(model, ids, mask=None, cfg=None, rng=None, *, mesh=None, trace: bool = False,
              slots: int | None = None):
    """This process's part of a generation: on the mesh (every process at once), or on one device."""
    return run(model, ids, mask, DecodeConfig() if cfg is None else cfg, rng, placement=decode_placement(mesh),
               trace=trace, slots=slots)


def _score(model, contexts, continuations, lcfg: LikelihoodConfig, *, mesh=None, greedy: bool = False,
           on_group=None):
    """This process's part of a likelihood evaluation: on the mesh (every process at once), or on one device."""
    score = greedy_match if greedy else loglikelihood_on
    return score(model, contexts, continuations, lcfg, placement=likelihood_placement(mesh), on_group=on_group)


def mesh_for_run(text: str | None):
    """The mesh a run generates on: `text` (data=D,model=M) over every device of every process; model=1
    for several processes given none; None for a lone process given none (the pmap path). A mistake in
    `text` is a DecodeError."""
    if text is None:
        if not is_multiprocess():
            return None
        text = "model=1"
    return mesh_from_text(text)


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
        """`load` on every process (the checkpoint must be at `path` on each host)."""
        path = Path(path).expanduser().resolve()
        meta = {"path": str(path), "dtype": checkpoint.parameter_dtype(dtype).name, "verify": bool(verify),
                "mesh": None if mesh is None else mesh_shape(mesh)}
        with signals_deferred():
            self._send(Message("load", meta))
            return self._collective(lambda: _load(path, dtype=dtype, verify=verify, mesh=mesh))

    def generate(self, model, ids, mask=None, cfg=None, rng=None, *, mesh=None, trace: bool = False,
                 slots: int | None = None):
        """`generate(..., mesh=mesh)` on every process, on the same inputs (the followers drop their copy of
        the output). Inputs are checked here first, so a mistake never reaches them."""
        cfg = DecodeConfig() if cfg is None else cfg
        if not self.has_followers:
            return _generate(model, ids, mask, cfg, rng, trace=trace, mesh=mesh, slots=slots)
        if mesh is None:
            raise DecodeError("a multi-process run generates on a mesh: pass mesh=make_mesh(...)")
        ids, mask = prompt_arrays(ids, mask)
        prepare_inputs(ids, mask, cfg, model.config, rng)  # raises what generate would, before anything is sent
        slots = check_slots(slots)
        # The rule files and modules the rule's (and a user's cache policy's) code comes from (a user's --rules): each
        # follower loads the same ones and checks their bytes are these, every process agreeing before the collective
        # generation.
        sources = sources_of(cfg.rule)
        sources += [s for s in ([] if isinstance(cfg.cache, str) else sources_of(cfg.cache)) if s not in sources]
        meta = {"config": cfg.to_json(), "trace": bool(trace), "key_impl": None, "mesh": mesh_shape(mesh),
                "rules": sources, "slots": slots}
        key = None
        if rng is not None:
            import jax
            meta["key_impl"] = str(jax.random.key_impl(rng))
            key = np.asarray(jax.random.key_data(rng))
        with signals_deferred():
            self._send(Message("generate", meta, ids=ids, mask=mask, key=key))
            if meta["rules"]:
                all_succeed(lambda: None, RulesError, "loading the rule files")
            return self._collective(lambda: _generate(model, ids, mask, cfg, rng, trace=trace, mesh=mesh, slots=slots))

    def loglikelihood(self, model, contexts, continuations, lcfg: LikelihoodConfig, *, mesh=None,
                      greedy: bool = False, on_group=None):
        """`loglikelihood(..., mesh=mesh)` on every process, on the same requests (the followers drop their copy).
        The requests are checked here first, so a mistake never reaches them."""
        if not self.has_followers:
            return _score(model, contexts, continuations, lcfg, mesh=mesh, greedy=greedy, on_group=on_group)
        if mesh is None:
            raise DecodeError("a multi-process run scores on a mesh: pass mesh=make_mesh(...)")
        pairs = check_requests(contexts, continuations, model.config)
        lcfg.validate()
        if not pairs:
            return _score(model, [], [], lcfg, mesh=mesh, greedy=greedy)
        ids, mask = left_pad([c + y for c, y in pairs], model.config.pad_token_id)
        meta = {"likelihood": lcfg.to_json(), "lengths": [len(y) for _, y in pairs], "greedy": bool(greedy),
                "mesh": mesh_shape(mesh)}
        contexts, continuations = [c for c, _ in pairs], [y for _, y in pairs]
        with signals_deferred():
            self._send(Message("loglikelihood", meta, ids=ids, mask=mask))
            return self._collective(lambda: _score(model, contexts, continuations, lcfg, mesh=mesh,
                                                          greedy=greedy, on_group=on_group))

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
                                   f"({first_line(e)})") from None


def mesh_shape(mesh) -> list[int]:
    """[data, model, expert] of a mesh, which the followers rebuild with `rebuild_mesh`: so it must be make_mesh's."""
    shape = [int(mesh.shape["data"]), int(mesh.shape["model"]), int(dict(mesh.shape).get("expert", 1))]
    if mesh != rebuild_mesh(shape):
        raise DecodeError(f"a multi-process run needs the mesh make_mesh(data={shape[0]}, model={shape[1]}, "
                          f"expert={shape[2]}) builds (the other processes rebuild it that way); this one orders its "
                          "devices otherwise")
    return shape


def rebuild_mesh(shape) -> Any:
    """The mesh `mesh_shape` described ([data, model] from an older leader: expert 1)."""
    data, model, *expert = shape
    return make_mesh(data, model, expert=expert[0] if expert else 1)


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

    def handle(self, msg: Message):
        """Carry out one message; returns what the call returned (the Generation of a generate message)."""
        if msg.kind == "load":
            return self.load(msg.meta)
        if msg.kind == "generate":
            return self.generate(msg)
        if msg.kind == "loglikelihood":
            return self.loglikelihood(msg)
        return None

    def load(self, meta: dict) -> None:
        self.model = None
        self.mesh = None if meta["mesh"] is None else rebuild_mesh(meta["mesh"])
        try:
            self.model = _load(meta["path"], dtype=meta["dtype"], verify=meta["verify"], mesh=self.mesh)
        except CheckpointError as e:  # every process raised (checkpoint.load agrees): the leader sends stop
            print(f"error: process {process_index()}: {e}", file=sys.stderr, flush=True)

    def _check_ready(self, msg: Message, what: str) -> None:
        if self.model is None:
            raise LostProcessError(f"process 0 asked for {what} before any model was loaded here")
        if self.mesh is None or list(msg.meta["mesh"]) != mesh_shape(self.mesh):
            raise LostProcessError(f"process 0 runs on mesh {msg.meta['mesh']}, this process loaded the model "
                                   f"on {None if self.mesh is None else dict(self.mesh.shape)}")

    def loglikelihood(self, msg: Message):
        self._check_ready(msg, "log-likelihoods")
        contexts, continuations = [], []
        for row, keep, length in zip(msg.ids, msg.mask, msg.meta["lengths"]):
            seq = row[keep.astype(bool)].tolist()
            contexts.append(seq[:len(seq) - length])
            continuations.append(seq[len(seq) - length:])
        return _score(self.model, contexts, continuations, LikelihoodConfig.from_json(msg.meta["likelihood"]),
                             mesh=self.mesh, greedy=msg.meta["greedy"])

    def generate(self, msg: Message):
        self._check_ready(msg, "a generation")
        if msg.meta.get("rules"):
            try:  # the leader's rule files, with the leader's bytes; a failure here is one on every process
                all_succeed(lambda: ensure_sources(msg.meta["rules"]), RulesError, "loading the rule files")
            except RulesError as e:  # the leader raises too and sends stop
                print(f"error: process {process_index()}: {e}", file=sys.stderr, flush=True)
                return None
        rng = None
        if msg.key is not None:
            import jax
            rng = jax.random.wrap_key_data(msg.key, impl=msg.meta["key_impl"])
        return _generate(self.model, msg.ids, msg.mask, DecodeConfig.from_json(msg.meta["config"]), rng,
                        trace=msg.meta["trace"], mesh=self.mesh, slots=msg.meta.get("slots"))


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
        os._exit(cli.EXIT_INTERRUPTED)

    def first_interrupt(signum, frame):
        print(f"note: process {process_index()} follows process 0, which ends the {what}; Ctrl-C again to "
              "quit now", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, second_interrupt)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, first_interrupt) if main_thread else None
    try:
        status = follow()
    except LostProcessError as e:
        exit_lost(f"process {process_index()}: {e}")
    except Exception as e:  # noqa: BLE001  (this process cannot go on: its end tells process 0)
        exit_lost(f"process {process_index()}: {type(e).__name__}: {first_line(e)}")
    finally:  # the caller's Ctrl-C as it was (a Python caller, a test: not left saying "follows process 0")
        if main_thread:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if status:
        print(f"stopped: process 0 ended the {what} with exit status {status} (its output says why)",
              file=sys.stderr, flush=True)
    return status


__all__ = ["Follower", "Leader", "follow", "follow_until_stopped", "leader", "leading", "mesh_for_run", "mesh_shape"]
