"""Compiled programs: kept in this process (each compiled once), and on disk across processes (JAX's
persistent compilation cache, so a rerun loads a program instead of compiling it again).

    executable, seconds = compile_once(key, lower, shapes)   # seconds: 0.0 when it was already compiled
    compiled_programs()                                      # every program compiled here, in order

The key names everything the program depends on besides its input values: the caller's settings and the
structure, static fields, shapes and dtypes of its pytree inputs (`signature`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Hashable, NamedTuple

import jax
import numpy as np


def _default_dir(setting: str) -> Path | None:
    """`LOCALLEAP_COMPILE_CACHE`: the directory, or "off" (or empty): the commands never turn the cache on."""
    return None if setting.strip().lower() in ("", "off") else Path(setting).expanduser()


DEFAULT_DIR: Path | None = _default_dir(os.environ.get("LOCALLEAP_COMPILE_CACHE", "~/.cache/localleap_jax/xla"))


def enable_compilation_cache(path: str | Path | None = None) -> Path | None:
    """Turn the persistent cache on (idempotent); every compiled program is stored under `path` (None: DEFAULT_DIR;
    returns None, turning nothing on, when that is off)."""
    if path is None and DEFAULT_DIR is None:
        return None
    path = Path(path or DEFAULT_DIR).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class Program(NamedTuple):
    """What one compiled program was compiled for (as `compiled_programs` lists it)."""

    kind: str  # who compiled it, e.g. "decode/one-device", "decode/pmap", "decode/mesh"
    shapes: tuple[tuple[int, ...], ...]  # the shapes of its array inputs, in order (a decode: ids first)
    seconds: float  # compile time
    executable: Any = None  # the compiled program (e.g. for its memory_analysis); None once forgotten


def signature(tree: Any) -> tuple:
    """A pytree's structure (static fields included) and its leaves' shapes, dtypes and, for arrays already placed,
    their shardings: what a compiled program depends on besides the values (a program compiled for weights split
    over a mesh refuses weights on one device)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((jax.ShapeDtypeStruct(np.shape(a), a.dtype),
                           a.sharding if isinstance(a, jax.Array) else None) for a in leaves)


_EXECUTABLES: dict[Hashable, Any] = {}
_PROGRAMS: list[Program] = []


def compile_once(kind: str, key: Hashable, lower: Callable[[], Any], shapes: tuple = ()) -> tuple[Any, float]:
    """The executable for `key`, compiled with `lower().compile()` only on first use; returns (executable,
    seconds spent compiling: 0.0 when it was compiled before in this process)."""
    full_key = (kind, key)
    if full_key in _EXECUTABLES:
        return _EXECUTABLES[full_key], 0.0
    t0 = time.perf_counter()
    _EXECUTABLES[full_key] = lower().compile()
    seconds = time.perf_counter() - t0
    _PROGRAMS.append(Program(kind, tuple(tuple(s) for s in shapes), seconds, _EXECUTABLES[full_key]))
    return _EXECUTABLES[full_key], seconds


def compiled_programs() -> tuple[Program, ...]:
    """Every program compiled in this process so far, oldest first (a counter: compare lengths before and after)."""
    return tuple(_PROGRAMS)


def forget_compiled() -> None:
    """Drop every executable held here (their memory; the next use compiles again, and is counted again)."""
    _EXECUTABLES.clear()
    _PROGRAMS[:] = [p._replace(executable=None) for p in _PROGRAMS]
