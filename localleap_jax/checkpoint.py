"""Checkpoint directories: write them atomically, load them into a `Model`.

A checkpoint directory holds
  config.json      the model's config (the HF one, copied, or one this project wrote); names the family
  params/          the Flax parameter tree, saved with Orbax
  tokenizer files  tokenizer.json, tokenizer_config.json, ... (copied verbatim)
  manifest.json    format tag, source, per-shard sha256, parameter dtype; written last
  README.md        where it came from
Everything is written into a sibling temporary directory that is renamed into place at the
end, so an interrupted write leaves nothing that `load` accepts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp

from localleap_jax.config import ConfigError, ModelConfig
from localleap_jax.model import Params, init_params
from localleap_jax.tokenizer import TOKENIZER_FILES, Tokenizer

FORMAT = "localleap-jax-checkpoint/1"
# The small model trained by experiments/train_tiny.py, shipped inside the package.
EMBEDDED = Path(__file__).resolve().parent / "assets" / "tiny-math"


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or does not match its config."""


@dataclasses.dataclass(frozen=True)
class Model:
    """Everything generation needs: the architecture, its weights and its tokenizer."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    path: Path | None = None

    @property
    def dtype(self) -> jnp.dtype:
        return self.params["wte"]["embedding"].dtype


def abstract_params(config: ModelConfig, dtype: Any = jnp.bfloat16) -> Params:
    """Shapes and dtypes of the parameter tree, without allocating it."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))


@contextmanager
def atomic_directory(out: str | Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; rename it to `out` only if the block succeeds."""
    out = Path(out).resolve()
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} already exists and is not empty; remove it or choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def write_params(path: str | Path, params: Params) -> None:
    """Save the tree with Orbax, one leaf's worth of bytes in flight at a time (bounded host memory:
    converting LLaDA-8B must fit in 24 GiB). Orbax's limit must admit the largest leaf."""
    import math

    import orbax.checkpoint as ocp

    largest = max(leaf.nbytes for leaf in jax.tree.leaves(params))
    limit_gb = max(1, math.ceil(largest / 1e9))
    handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=limit_gb, save_device_host_concurrent_gb=limit_gb)
    ocp.Checkpointer(handler).save(Path(path).resolve(), args=ocp.args.PyTreeSave(params))


def write_checkpoint_files(tmp: Path, *, hf_config: Mapping[str, Any], params: Params, tokenizer_dir: str | Path,
                           manifest: Mapping[str, Any], readme: str) -> None:
    """Fill a (temporary) checkpoint directory; manifest.json goes last, as the completion mark."""
    (tmp / "config.json").write_text(json.dumps(dict(hf_config), indent=2))
    write_params(tmp / "params", params)
    tokenizer_files = copy_tokenizer_files(tokenizer_dir, tmp)
    if "tokenizer.json" not in tokenizer_files:
        raise CheckpointError(f"{tokenizer_dir} has no tokenizer.json")
    (tmp / "README.md").write_text(readme)
    leaves = jax.tree.leaves(params)
    body = {"format": FORMAT, "param_dtype": str(leaves[0].dtype), "tokenizer_files": tokenizer_files, **manifest}
    (tmp / "manifest.json").write_text(json.dumps(body, indent=2))


def save(out: str | Path, config: ModelConfig, params: Params, tokenizer_dir: str | Path, *,
         hf_config: Mapping[str, Any] | None = None, manifest: Mapping[str, Any] | None = None,
         readme: str = "") -> Path:
    """Write a checkpoint directory atomically (see the module docstring)."""
    _check_tree(params, abstract_params(config, jax.tree.leaves(params)[0].dtype), "params to save")
    with atomic_directory(out) as tmp:
        write_checkpoint_files(tmp, hf_config=hf_config or config.to_hf_dict(), params=params,
                               tokenizer_dir=tokenizer_dir, manifest=manifest or {},
                               readme=readme or f"# {config.family} checkpoint\n\n{json.dumps(config.to_hf_dict())}\n")
    return Path(out)


def resolve_checkpoint(name: str | Path | None) -> Path:
    """A checkpoint directory from a name: None/"embedded" (the shipped small model), a directory,
    or a hub id such as GSAI-ML/LLaDA-8B-Instruct or Dream-org/Dream-v0-Instruct-7B (converted once
    into a cache, then reused)."""
    if name is None or str(name) in ("", "embedded"):
        if not (EMBEDDED / "manifest.json").exists():
            raise CheckpointError(f"the embedded model is missing ({EMBEDDED}); reinstall the package")
        return EMBEDDED
    path = Path(name).expanduser()
    if path.exists() or str(name).count("/") != 1 or str(name).startswith((".", "/", "~")):
        return path
    from localleap_jax.convert_hf import cached_conversion  # a hub id (convert_hf imports this module)
    return cached_conversion(str(name))


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory")
    if (path / "model.safetensors.index.json").exists() or list(path.glob("*.safetensors")):
        raise CheckpointError(f"{path} is a Hugging Face checkpoint; convert it first: "
                              f"python -m convert {path} OUT")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete localleap-jax checkpoint (no manifest.json; "
                              "an interrupted conversion leaves none)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}/manifest.json is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}/manifest.json has format {manifest.get('format')!r}; expected {FORMAT!r}")
    return manifest


def hash_params_files(params_dir: str | Path, chunk: int = 1 << 26) -> dict[str, str]:
    """sha256 of every file under params/, by path relative to it (chunked reads: bounded memory)."""
    import hashlib

    params_dir = Path(params_dir)
    out = {}
    for f in sorted(p for p in params_dir.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
        out[f.relative_to(params_dir).as_posix()] = h.hexdigest()
    return out


def fingerprint_of(file_hashes: Mapping[str, str]) -> str:
    """One hex digest naming the parameter contents (independent of where the directory lives)."""
    import hashlib

    return hashlib.sha256("".join(f"{k}\t{v}\n" for k, v in sorted(file_hashes.items())).encode()).hexdigest()


def params_fingerprint(path: str | Path) -> str:
    """Content fingerprint of a checkpoint's parameters: the one manifest.json recorded when the
    checkpoint was written, else computed now from the files under params/."""
    manifest = read_manifest(path)
    recorded = manifest.get("params_fingerprint")
    if isinstance(recorded, str) and recorded:
        return recorded
    return fingerprint_of(hash_params_files(Path(path) / "params"))


def load(path: str | Path, dtype: str | Any = "bfloat16") -> Model:
    """Restore a checkpoint directory with Orbax, straight into `dtype` on the default device."""
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().resolve()
    read_manifest(path)
    try:
        config = ModelConfig.from_json_file(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise CheckpointError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32") from None
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path} has no params/ directory")
    ckptr = ocp.StandardCheckpointer()
    try:
        stored = ckptr.metadata(path / "params").item_metadata.tree
    except Exception as e:  # Orbax raises several types for unreadable metadata
        raise CheckpointError(f"{path}/params is not a readable Orbax checkpoint: {e}") from None
    expected = abstract_params(config, dtype)
    _check_tree(stored, expected, f"{path}/params")
    device = jax.devices()[0]
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device)),
                          expected)
    params = ckptr.restore(path / "params", target)
    tokenizer = Tokenizer.from_dir(path, mask_id=config.mask_token_id, eos_id=config.eos_token_id,
                                   pad_id=config.pad_token_id)
    return Model(config, params, tokenizer, path)


def _check_tree(found, expected, what: str) -> None:
    """Name every missing, unexpected and wrongly shaped leaf instead of failing inside Orbax."""
    def flat(tree):
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    f, e = flat(found), flat(expected)
    problems = [f"missing {k}" for k in sorted(e.keys() - f.keys())]
    problems += [f"unexpected {k}" for k in sorted(f.keys() - e.keys())]
    problems += [f"{k} has shape {f[k]}, config.json implies {e[k]}" for k in sorted(e.keys() & f.keys()) if f[k] != e[k]]
    if problems:
        raise CheckpointError(f"{what} does not match config.json: " + "; ".join(problems))
