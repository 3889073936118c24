"""The model of an evaluation: found (a directory, the embedded model or a hub id), its length checked
against the canvas before any weight is read, then loaded on every process at once."""

from __future__ import annotations

from pathlib import Path

from localleap_jax.checkpoint import CheckpointError, read_manifest
from localleap_jax.config import ConfigError, ModelConfig
from localleap_jax.resolve import resolve_checkpoint
from localleap_jax.decode import DecodeError, check_room
from localleap_jax.dist.multihost import leader
from localleap_jax.errors import UserError
from localleap_jax.lm_eval import default_dtype
from localleap_jax.families import read_config_file


def find_checkpoint(name: str | None) -> tuple[Path, dict]:
    """(checkpoint directory, its manifest) for --checkpoint/--model; checkpoint problems are user errors."""
    try:
        path = resolve_checkpoint(name)
        return path, read_manifest(path)
    except (CheckpointError, ConfigError) as e:
        raise UserError(str(e)) from None


def read_model_config(path: Path) -> ModelConfig:
    """The checkpoint's ModelConfig from its config.json (before loading the weights)."""
    try:
        return read_config_file(path / "config.json")
    except ConfigError as e:
        raise UserError(f"{path}: {e}") from None


def check_gen_length(gen_length: int, path: Path) -> None:
    """--gen-length against the model's length, from config.json (before loading the weights)."""
    limit = read_model_config(path).max_sequence_length
    try:
        check_room(gen_length, limit)
    except DecodeError as e:  # named as the command lines' flag: "--gen-length 512 leaves no room ..."
        raise UserError(str(e).replace(f"gen_length={gen_length}", f"--gen-length {gen_length}", 1)) from None


def load_model(path: Path, dtype: str, mesh=None):
    """The checkpoint at `path` in `dtype` ("auto": fp32 on CPU, bf16 on an accelerator), on `mesh` if given."""
    try:  # on every process at once when there are several
        return leader().load(path, dtype=default_dtype() if dtype == "auto" else dtype, mesh=mesh)
    except (CheckpointError, ConfigError) as e:
        raise UserError(str(e)) from None
