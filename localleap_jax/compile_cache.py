"""JAX's persistent compilation cache, so a rerun loads compiled programs instead of compiling again."""

from __future__ import annotations

import os
from pathlib import Path

import jax

DEFAULT_DIR = Path(os.environ.get("LOCALLEAP_COMPILE_CACHE", "~/.cache/localleap_jax/xla")).expanduser()


def enable_compilation_cache(path: str | Path | None = None) -> Path:
    """Turn the cache on (idempotent); every compiled program is stored under `path`."""
    path = Path(path or DEFAULT_DIR).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
