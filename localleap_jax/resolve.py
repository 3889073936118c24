"""Where a checkpoint name points: the first of the three steps of `ll.load` (resolve, open, restore).

    resolve_checkpoint(name) -> Path    # "embedded..." (a shipped small model), a directory, or a hub id

A hub id (owner/repo) is converted once into CACHE_DIR and reused; this is the only place a load converts.
"""

from __future__ import annotations

import sys
from os import PathLike
from pathlib import Path

from localleap_jax.checkpoint import EMBEDDED, EMBEDDED_MODELS
from localleap_jax.convert_hf import convert
from localleap_jax.errors import CheckpointError, ConversionError

CACHE_DIR = Path("~/.cache/localleap_jax/checkpoints").expanduser()


def resolve_checkpoint(name: str | Path | None) -> Path:
    """A checkpoint directory from a name: None/"embedded" (the shipped small model), "embedded-sdar" (its
    block-diffusion twin), "embedded-dg" (its DiffusionGemma twin), "embedded-chain" (the chain-task model, on
    which the rules differ),
    a directory, or a hub id such as GSAI-ML/LLaDA-8B-Instruct or
    Dream-org/Dream-v0-Instruct-7B (converted once into a cache, then reused)."""
    if name is not None and not isinstance(name, (str, PathLike)):
        raise CheckpointError(f"a checkpoint is named by a str or Path: a checkpoint directory, "
                              f"{', '.join(map(repr, EMBEDDED_MODELS))} or a hub id; got {type(name).__name__} "
                              f"{name!r:.40}")
    if name is None or str(name) in ("", *EMBEDDED_MODELS):
        path = EMBEDDED_MODELS.get(str(name), EMBEDDED)
        if not (path / "manifest.json").exists():
            raise CheckpointError(f"the embedded model is missing ({path}); reinstall the package")
        return path
    if not is_hub_id(name):
        return Path(name).expanduser()
    return cached_conversion(str(name))


def is_hub_id(name: str | Path | None) -> bool:
    """Whether `name` reads as a hub id (owner/repo) rather than a local path: no such path exists, one
    slash, and it does not start like a path (".", "/", "~")."""
    if name is None or str(name) in ("", *EMBEDDED_MODELS):
        return False
    text = str(name)
    return not Path(text).expanduser().exists() and text.count("/") == 1 and not text.startswith((".", "/", "~"))


def cached_conversion(hub_id: str, cache_dir: Path = CACHE_DIR) -> Path:
    """The converted checkpoint of a hub id, converting it on first use (later calls reuse it)."""
    out = Path(cache_dir) / hub_id.replace("/", "__")
    if (out / "manifest.json").exists():
        return out
    print(f"converting {hub_id} into {out} (once)", file=sys.stderr)
    try:
        return convert(hub_id, str(out))
    except ConversionError as e:
        raise CheckpointError(str(e)) from None
