"""Rows finished inside a compiled call, told to the caller as they finish (continuous batching's progress).

    with rows_finished(lambda finished, passes: bar.update(finished)):   # the caller's listener, for the calls
        out = ll.generate(model, ids, mask, cfg, slots=S)                  # inside the block

A slots call (decode/slots.py) made while a listener is set compiles a program that reports, after a pass in which
prompts finished and after every EVERY-th pass, how many prompts finished in it and how many passes the call has
run (a `jax.debug.callback` to `report`, which hands both to the listener on the runtime's thread; each data shard
reports its own). A call made without a listener compiles none of it: its program is the one it always was. Such
a program costs a host round trip per report (~0.1 ms on CPU) and JAX keeps no program with a host callback in its
persistent compilation cache. A fixed batch reports nothing: its rows come back together at its end. One process
only: a multi-process run's programs must be the same on every process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

EVERY = 8  # a pass in which no prompt finished is reported once in this many (its pass count alone)

_LOCK = threading.Lock()
_LISTENERS: list[Callable[[int, int], None]] = []


@contextmanager
def rows_finished(listener: Callable[[int, int], None]) -> Iterator[None]:
    """Calls inside the block report every pass to `listener(prompts finished in it, passes run so far)` (nested:
    the innermost listener)."""
    with _LOCK:
        _LISTENERS.append(listener)
    try:
        yield
    finally:
        with _LOCK:
            _LISTENERS.remove(listener)


def listening() -> bool:
    """Whether a call made now should compile the report (a listener is set)."""
    return bool(_LISTENERS)


def report(finished, passes) -> None:
    """The compiled program's callback: `finished` prompts finished in the pass just run, the `passes`-th (one data
    shard's)."""
    with _LOCK:
        listener = _LISTENERS[-1] if _LISTENERS else None
    if listener is not None:
        listener(int(np.asarray(finished)), int(np.asarray(passes)))
