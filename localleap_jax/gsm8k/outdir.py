"""The output directory: checked before anything is created, held by one run at a time (every command that writes
one: eval_gsm8k, sweep, eval_likelihood, analyze_dynamics), removed when a run produced nothing, and its result
files replaced whole."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from localleap_jax import cli
from localleap_jax.errors import UserError
from localleap_jax.hashing import sha256_json
from localleap_jax.gsm8k.progress import Progress


def check_output(out: Path) -> None:
    """Refuse an --output that cannot be a directory or cannot be written, before anything is loaded or created
    (nothing is left behind: `cli.check_writable_dir`)."""
    cli.check_writable_dir(out, "--output")


def default_output(parent: Path, checkpoint: Path, manifest: dict | None = None, prefix: str = "",
                   run: dict | None = None) -> Path:
    """PARENT/<prefix><checkpoint's name>-<8 hex>[-<8 hex>]: the first hex is the weights' fingerprint (manifest.json),
    or the resolved path's hash where there is none, so two checkpoints of one basename (runs/a/model, runs/b/model)
    never share a default --output, while the same weights copied elsewhere resume from theirs; the second, given
    `run` (what the run's results depend on), is its digest, so runs that would give other results (other
    strategies, other data) never replace each other's summary."""
    resolved = Path(checkpoint).expanduser().resolve()
    tag = (manifest or {}).get("params_fingerprint") or hashlib.sha256(str(resolved).encode()).hexdigest()
    name = f"{prefix}{resolved.name}-{str(tag)[:8]}"
    if run is not None:
        name += f"-{sha256_json(run)[:8]}"
    return parent / name


class OutputDir:
    """The --output directory, held by one run at a time through OUT/.lock (the holder's pid and host).

    The lock is a kernel lock (flock) on that file, so it ends with its process however that process
    ends; the file only names the holder. A lock file left by a run that died is taken over with a note."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = path / ".lock"
        self.created: Path | None = None  # the topmost directory this run created, removed by discard()
        self._fd: int | None = None

    def claim(self) -> str | None:
        """Create and lock the directory; returns a note when a dead run's lock was taken over."""
        self.created = next((p for p in (*reversed(self.path.parents), self.path) if not p.exists()), None)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = self._holder(fd)
                    os.close(fd)
                    raise UserError(f"--output {self.path} is in use by another run ({holder}); wait for it to "
                                    "finish or choose another --output") from None
                if self.lock.exists() and os.stat(self.lock).st_ino == os.fstat(fd).st_ino:
                    break
                os.close(fd)  # the holder removed the file between our open and flock: lock the new one
        except OSError as e:
            self.discard()
            raise UserError(f"--output {self.path}: cannot write there ({e.strerror})") from None
        self._fd = fd
        previous = self._holder(fd) if os.fstat(fd).st_size else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        if previous:
            return f"took over {self.lock}, left by a run that ended without releasing it ({previous})"
        return None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.lock.unlink()  # while still locked, so nobody locks the old file in between
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def discard(self) -> None:
        """Remove what this run created (used when it ends before producing anything)."""
        if self.created is not None and self.created.exists():
            shutil.rmtree(self.created, ignore_errors=True)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0))
            return f"pid {info['pid']} on {info['host']} since {info['since']}"
        except (ValueError, KeyError, TypeError, OSError):
            return "holder unknown"


@contextmanager
def held_output(out: Path, produced: Callable[[], bool], discarded: Callable[[], None] = lambda: None
                ) -> Iterator[OutputDir]:
    """Hold OUT for this run (a second run into it is refused, whichever command it is); on the way out let go of
    it, and remove it if this run created it and `produced()` says nothing was made (an error or Ctrl-C before the
    first result leaves nothing behind; `discarded()` is then called). The same happens when the program is ended
    by its watchdog (a Ctrl-C while a compiled call runs: `cli.if_abandoned`)."""
    claim = OutputDir(out)
    note = claim.claim()
    if note:
        print(f"note: {note}", file=sys.stderr)
    state = {"finished": False, "let_go": False}
    lock = threading.Lock()

    def let_go() -> None:  # once, from whichever thread comes first (the run's own or the watchdog's)
        with lock:
            if state["let_go"]:
                return
            state["let_go"] = True
            claim.release()
            if not state["finished"] and not produced():
                claim.discard()
                if claim.created is not None:
                    discarded()

    try:
        with cli.if_abandoned(let_go):
            yield claim
        state["finished"] = True
    finally:
        let_go()


@contextmanager
def holding(out: Path, progress: Progress):
    """`held_output` for an evaluation: what it produced is `progress`'s answers; `progress` learns whether OUT
    was removed (what the interrupted line says)."""
    progress.out = out
    with held_output(out, lambda: progress.answers > 0, lambda: setattr(progress, "discarded", True)):
        yield


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` whole: an interrupted write never leaves a torn file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
