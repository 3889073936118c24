"""Reading a checkpoint directory in two steps: `open_checkpoint` (manifest.json and config.json read once, the
parameter files' layout and Orbax metadata checked: cheap, the same on every process), then `restore` (the
parameters into a dtype, on one device or straight into each leaf's shards on a mesh, their hashes checked beside
it). `load` does both and reads the tokenizer."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from localleap_jax.checkpoint.manifest import check_params_content, check_params_layout, read_manifest
from localleap_jax.config import ModelConfig
from localleap_jax.errors import CheckpointError, ConfigError, TokenizerError, first_line
from localleap_jax.families import decoding_params, init_params, read_config_file
from localleap_jax.loaded import Model
from localleap_jax.model import Params
from localleap_jax.partition import param_shardings
from localleap_jax.tokenizer import Tokenizer

PARAM_DTYPES = ("bfloat16", "float16", "float32")  # what `load` restores parameters into


def abstract_params(config: ModelConfig, dtype: Any = jnp.bfloat16) -> Params:
    """Shapes and dtypes of the parameter tree, without allocating it."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))


def check_finite(params: Params, what: str) -> None:
    """Refuse NaN/inf anywhere in the tree, naming the leaves.

    One fused count per leaf; on a mesh each device counts its own shard and only the counts are
    summed across devices (never a gather of the weights), and every process gets the same totals,
    so on several processes all of them raise or none does."""
    bad = [(jax.tree_util.keystr(k), n) for k, n in non_finite_counts(params).items() if n]
    if bad:
        raise CheckpointError(f"{what}: " + "; ".join(f"{k} holds {n} non-finite value(s)" for k, n in bad)
                              + " (NaN/inf: the weights are corrupted)")


@jax.jit
def count_non_finite(a: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(a), dtype=jnp.int32)


def non_finite_counts(params: Params) -> dict:
    """{key path: number of NaN/inf values} for every leaf of a (possibly sharded, multi-process) tree.

    Leaf by leaf: one program over the whole tree made XLA (CPU) hold a further ~0.9x the model's bytes."""
    counts = [(k, count_non_finite(leaf)) for k, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
    # A count is replicated over the leaf's devices; read it from one this process holds.
    return {k: int(np.asarray(n.addressable_data(0))) for k, n in counts}


def parameter_dtype(dtype: str | Any) -> jnp.dtype:
    """bfloat16, float16 or float32 (what the model computes in), from a name or dtype."""
    try:
        parsed = jnp.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed is None or parsed.name not in PARAM_DTYPES:
        raise CheckpointError(f"parameter dtype {dtype!r} is not supported; use one of {', '.join(PARAM_DTYPES)}")
    return parsed


@dataclasses.dataclass(frozen=True)
class Opened:
    """A checkpoint directory whose manifest, config and parameter layout have been read and checked (no
    parameter read yet): what every later step is handed instead of reading the files again."""

    path: Path
    manifest: Mapping[str, Any]
    config: ModelConfig
    stored: Any  # the stored tree's shapes (Orbax metadata)

    @property
    def recorded(self) -> Mapping[str, Mapping] | None:
        """manifest.json's per-file sizes and hashes of params/ (None: an older checkpoint that records none)."""
        return self.manifest.get("params_files")


def open_checkpoint(path: str | Path) -> Opened:
    """Read manifest.json and config.json once, and check the files under params/ against them (names and sizes,
    Orbax's metadata): cheap, and the same on every process."""
    import orbax.checkpoint as ocp

    path = Path(path).expanduser().resolve()
    manifest = read_manifest(path)
    try:
        config = read_config_file(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path} has no params/ directory")
    if manifest.get("params_files") is not None:
        check_params_layout(path / "params", manifest["params_files"])
    try:
        stored = ocp.StandardCheckpointer().metadata(path / "params").item_metadata.tree
    except Exception as e:  # Orbax raises several types for unreadable metadata
        raise CheckpointError(f"{path}/params is not a readable Orbax checkpoint: {e}") from None
    check_tree(stored, abstract_params(config), f"{path}/params")
    return Opened(path, manifest, config, stored)


def load(path: str | Path | Opened, dtype: str | Any = "bfloat16", verify: bool = True, mesh=None,
         agree: Callable[[Callable[[], Any], str], Any] | None = None) -> Model:
    """Restore a checkpoint directory (or an already `Opened` one) with Orbax, straight into `dtype`: on one local
    device, or, with `mesh` (localleap_jax.partition.make_mesh), straight into each parameter's shards on the mesh.

    On a mesh each device reads only its own slices of the files (Orbax restores into the
    NamedShardings of `partition.param_shardings`), so no host and no device ever holds the whole model
    when the mesh splits it.

    The files under params/ must have the sizes manifest.json recorded; with `verify` (default)
    also the same sha256, hashed on other threads while Orbax restores (about 2 s/GB on one
    busy core; `verify=False` skips it). Parameters that are not finite are always refused.

    `agree(step, what)` runs each step of the load (open, restore, tokenizer) and returns its result; by
    default the step just runs here. Several processes loading together pass one that runs the step on every
    process and raises on all of them if it failed on any (`ll.load` does, with `processes.all_succeed`), so
    none is left waiting for the others; the non-finite check gives the same verdict on every process.
    """
    agree = agree or (lambda step, what: step())
    dtype = agree(lambda: parameter_dtype(dtype), "the parameter dtype")
    if isinstance(path, Opened):
        opened = path
    else:
        where = Path(path).expanduser().resolve()
        opened = agree(lambda: open_checkpoint(where), f"opening {where}")
    if verify and opened.recorded is None:
        import warnings
        warnings.warn(f"{opened.path}/manifest.json records no parameter hashes (written by an older version): "
                      "not verified", stacklevel=3)
    params = agree(lambda: restore(opened, dtype, verify=verify, mesh=mesh), f"reading {opened.path}/params")
    check_finite(params, f"{opened.path}/params")  # the same verdict on every process
    # One array per layer for decoding, each stored stack freed once split: never two copies of the weights.
    params = decoding_params(params, opened.config, free=True)
    tokenizer = agree(lambda: _tokenizer_of(opened.path, opened.config), f"reading {opened.path}'s tokenizer")
    return Model(opened.config, params, tokenizer, opened.path)


def _target_shardings(expected: Params, mesh):
    """Where each leaf is restored: its shards on `mesh`, or whole on this process's first device."""
    if mesh is not None:
        return param_shardings(expected, mesh)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # a device this process can address
    return jax.tree.map(lambda _: device, expected)


def restore(opened: Opened, dtype: Any, *, verify: bool = True, mesh=None) -> Params:
    """The parameters, restored by Orbax into `dtype` and their target shardings (one device, or `mesh`'s), with
    the files' hashes checked beside it when `verify` and manifest.json records them."""
    import orbax.checkpoint as ocp

    path, dtype = opened.path, parameter_dtype(dtype)
    expected = abstract_params(opened.config, dtype)
    target = jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, dtype, sharding=sharding),
                          expected, _target_shardings(expected, mesh))
    hash_it = verify and opened.recorded
    # The hash runs beside the restore (both only read params/); a mismatch outranks a restore
    # error, which is what damaged data usually causes.
    with ThreadPoolExecutor(max_workers=1) as background:
        hashing = background.submit(check_params_content, path / "params", opened.recorded) if hash_it else None
        try:
            params = ocp.StandardCheckpointer().restore(path / "params", target)
        except Exception as e:  # TensorStore/Orbax errors for damaged data files: one line naming the directory
            if hashing is not None:
                hashing.result()
            raise CheckpointError(f"{path}/params could not be read ({first_line(e)})") from None
        if hashing is not None:
            hashing.result()
    return params


def _tokenizer_of(path: Path, config: ModelConfig) -> Tokenizer:
    try:
        return Tokenizer.from_dir(path, mask_id=config.mask_token_id, eos_id=config.eos_token_id,
                                  pad_id=config.pad_token_id, end_ids=config.end_ids,
                                  masked=not config.canvas_length)
    except TokenizerError as e:
        raise CheckpointError(f"{path}: {e}") from None


def check_tree(found, expected, what: str) -> None:
    """Name every missing, unexpected and wrongly shaped leaf instead of failing inside Orbax."""
    def flat(tree):
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    f, e = flat(found), flat(expected)
    problems = [f"missing {k}" for k in sorted(e.keys() - f.keys())]
    problems += [f"unexpected {k}" for k in sorted(f.keys() - e.keys())]
    problems += [f"{k} has shape {f[k]}, config.json implies {e[k]}" for k in sorted(e.keys() & f.keys()) if f[k] != e[k]]
    if problems:
        raise CheckpointError(f"{what} does not match config.json: " + "; ".join(problems))
