"""Content hashes: of files (data, tokenizers, safetensors shards) and of JSON-able records (resume keys)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

_READ = 1 << 24  # bytes per read: a large file never sits in memory whole


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of one file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: Iterable[str | Path], *, names: bool = False) -> str:
    """Hex sha256 of several files' contents in order (with `names`, each file's name goes in before it, so
    renaming a file changes the digest; without, only what the files hold counts)."""
    h = hashlib.sha256()
    for path in paths:
        if names:
            h.update(f"{Path(path).name}\n".encode())
            with open(path, "rb") as f:
                while block := f.read(_READ):
                    h.update(block)
        else:
            h.update(bytes.fromhex(sha256_file(path)))
    return h.hexdigest()


def sha256_json(value: Any) -> str:
    """Hex sha256 of a JSON-able value, keys sorted (what names a resume cache)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
