"""Checkpoint directories: write them atomically, load them into a `Model`.

A checkpoint directory holds
  config.json      the model's config (the HF one, copied, or one this project wrote); names the family
  params/          the Flax parameter tree, saved with Orbax
  tokenizer files  tokenizer.json, tokenizer_config.json, ... (copied verbatim)
  manifest.json    format tag, source, per-shard sha256, parameter dtype, and the content hash of
                   every file under params/ with their fingerprint; written last
  README.md        where it came from
Everything is written into a sibling temporary directory that is renamed into place at the
end, so an interrupted write leaves nothing that `load` accepts (and, Ctrl-C included, nothing
at all). `load` checks the recorded hashes (`verify=False` skips that) and refuses parameters
that are not finite.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from localleap_jax.config import ConfigError, ModelConfig
from localleap_jax.denoiser import ModelDenoiser, SpecialIds
from localleap_jax.errors import CheckpointError, first_line
from localleap_jax.model import Params, init_params
from localleap_jax.partition import model_split_axis, param_shardings, path_names
from localleap_jax.tokenizer import TOKENIZER_FILES, Tokenizer, TokenizerError

FORMAT = "localleap-jax-checkpoint/1"
PARAM_DTYPES = ("bfloat16", "float16", "float32")  # what `load` restores parameters into
# The small model trained by experiments/train_tiny.py, shipped inside the package.
EMBEDDED = Path(__file__).resolve().parent / "assets" / "tiny-math"
EMBEDDED_SDAR = Path(__file__).resolve().parent / "assets" / "tiny-math-sdar"  # its block-diffusion twin
# Trained on six-step chains (synthetic_math's chain6), where committing a step's result before the step it
# builds on costs accuracy.
EMBEDDED_CHAIN = Path(__file__).resolve().parent / "assets" / "tiny-chain"
EMBEDDED_MODELS = {"embedded": EMBEDDED, "embedded-sdar": EMBEDDED_SDAR,  # the names `load` takes for them
                   "embedded-chain": EMBEDDED_CHAIN}


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

    @property
    def denoiser(self) -> ModelDenoiser:
        """What the decode loop runs (the parameters and the config, model.py's pure functions)."""
        return ModelDenoiser(self.params, self.config)

    @property
    def special(self) -> SpecialIds:
        """The ids the decode loop treats specially: mask and EOS from the config, EOT and the decodable ids
        from the tokenizer."""
        return SpecialIds.of(self.config, self.tokenizer)


def abstract_params(config: ModelConfig, dtype: Any = jnp.bfloat16) -> Params:
    """Shapes and dtypes of the parameter tree, without allocating it."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))


def check_output_path(out: str | Path) -> Path:
    """`out` resolved, if a checkpoint may be written there: absent, or an empty directory."""
    out = Path(out).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; the output must be a directory that does not exist yet (or is empty)")
    if out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"{out} already exists and is not empty; remove it or choose another path")
    return out


@contextmanager
def atomic_directory(out: str | Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; rename it to `out` only if the block succeeds.

    The directory gets the mode a plain `mkdir` would (the umask's), not mkdtemp's 0700: a
    checkpoint on a shared machine is meant to be read by others. Whatever happens inside the
    block (an error, Ctrl-C), the temporary directory is removed.
    """
    out = check_output_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {e.strerror or e}") from None
    # Named before it exists and made inside the try: a Ctrl-C landing just after mkdir made it (inside mkdtemp
    # it would escape before the name came back) still finds it to remove. 64 random bits: no collision to retry.
    tmp = out.parent / f".{out.name}.partial-{secrets.token_hex(8)}"
    ours = True
    try:
        try:
            tmp.mkdir(mode=0o777)  # minus the umask, as a plain mkdir: a checkpoint is meant to be read by others
        except FileExistsError:
            ours = False
            raise CheckpointError(f"cannot write {out}: {tmp} already exists") from None
        except OSError as e:
            raise CheckpointError(f"cannot write {out}: {e.strerror or e}") from None
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as e:  # disk full, permissions, ...: one line naming the output
        raise CheckpointError(f"could not write {out}: {e}") from None
    finally:
        if ours:
            _remove_tree(tmp)


def _remove_tree(path: Path) -> None:
    """rmtree that a second Ctrl-C cannot cut short (half a partial directory is still a leftover)."""
    for _ in range(5):
        try:
            shutil.rmtree(path, ignore_errors=True)
            return
        except KeyboardInterrupt:
            continue


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


# Stored chunk size. Orbax's default stores each array as one chunk (up to 2 GiB); a chunk is what
# is read and decompressed whole, so a load into shards would read every leaf whole on every host.
# Chunks this size, cut along the dimension the model axis splits, let a host read only its own.
CHUNK_BYTES = 64 * 2**20


def chunking(params: Params, chunk_bytes: int | None = CHUNK_BYTES):
    """Orbax SaveArgs per leaf: chunks of at most `chunk_bytes`, cut first along the dimension the
    model axis splits (localleap_jax.partition.model_split_axis). None: one chunk per array."""
    import orbax.checkpoint as ocp

    def save_args(keypath, leaf):
        axis = model_split_axis(path_names(keypath), tuple(leaf.shape))
        return ocp.SaveArgs(chunk_byte_size=chunk_bytes, shard_axes=() if axis is None else (axis,))
    return jax.tree_util.tree_map_with_path(save_args, params)


def write_params(path: str | Path, params: Params, chunk_bytes: int | None = CHUNK_BYTES) -> None:
    """Save the tree with Orbax, one leaf's worth of bytes in flight at a time (bounded host memory:
    converting LLaDA-8B must fit in 24 GiB). Orbax's limit must admit the largest leaf. Arrays are
    stored in chunks of `chunk_bytes` (see CHUNK_BYTES).

    The save runs on a worker thread that a Ctrl-C waits for: interrupted mid-save, Orbax's own
    writer threads would keep creating files after the caller removed the temporary directory.
    """
    import math

    import orbax.checkpoint as ocp

    largest = max(leaf.nbytes for leaf in jax.tree.leaves(params))
    limit_gb = max(1, math.ceil(largest / 1e9))
    handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=limit_gb, save_device_host_concurrent_gb=limit_gb)
    failure: list[BaseException] = []
    done = threading.Event()

    def save():
        try:
            ocp.Checkpointer(handler).save(Path(path).resolve(), args=ocp.args.PyTreeSave(
                params, save_args=chunking(params, chunk_bytes)))
        except BaseException as e:  # re-raised on the calling thread
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=save, name="orbax-save").start()
    caught = _wait_holding_interrupts(done)
    if caught is not None:  # the write is complete: now the caller may clean up
        if caught != signal.SIGINT:
            signal.raise_signal(caught)  # its own handler (a command line's: KeyboardInterrupt naming it)
        raise KeyboardInterrupt
    if failure:
        raise failure[0]


def _wait_holding_interrupts(done: threading.Event) -> int | None:
    """Wait for `done`; a Ctrl-C meanwhile is remembered instead of raised, and so is a SIGTERM or SIGHUP whose
    handler is Python code (a command line's: one that unwinds, cleaning up). Returns the signal that came.

    Not a try/except around `Thread.join`: an interrupted join marks a live thread as finished
    (CPython 3.11), and the interrupt could also land between two waits.
    """
    if threading.current_thread() is not threading.main_thread():  # signals only reach the main thread
        done.wait()
        return None
    held = [signal.SIGINT] + [getattr(signal, n) for n in ("SIGTERM", "SIGHUP")
                              if hasattr(signal, n) and callable(signal.getsignal(getattr(signal, n)))]
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        done.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else
                          (signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL))
    return caught[0] if caught else None


def write_checkpoint_files(tmp: Path, *, hf_config: Mapping[str, Any], params: Params, tokenizer_dir: str | Path,
                           manifest: Mapping[str, Any], readme: str, chunk_bytes: int | None = CHUNK_BYTES) -> None:
    """Fill a (temporary) checkpoint directory; manifest.json goes last, as the completion mark."""
    (tmp / "config.json").write_text(json.dumps(dict(hf_config), indent=2))
    write_params(tmp / "params", params, chunk_bytes)
    tokenizer_files = copy_tokenizer_files(tokenizer_dir, tmp)
    if "tokenizer.json" not in tokenizer_files:
        raise CheckpointError(f"{tokenizer_dir} has no tokenizer.json")
    (tmp / "README.md").write_text(readme)
    leaves = jax.tree.leaves(params)
    files = params_file_records(tmp / "params")
    body = {"format": FORMAT, "param_dtype": str(leaves[0].dtype), "tokenizer_files": tokenizer_files, **manifest,
            "params_fingerprint": fingerprint_of({k: v["sha256"] for k, v in files.items()}),
            "params_digest": PARAMS_DIGEST, "params_files": files}
    (tmp / "manifest.json").write_text(json.dumps(body, indent=2))


def save(out: str | Path, config: ModelConfig, params: Params, tokenizer_dir: str | Path, *,
         hf_config: Mapping[str, Any] | None = None, manifest: Mapping[str, Any] | None = None,
         readme: str = "", chunk_bytes: int | None = CHUNK_BYTES) -> Path:
    """Write a checkpoint directory atomically (see the module docstring). Non-finite parameters
    (a training run that diverged) are refused before anything is written. `chunk_bytes`: see
    CHUNK_BYTES (None: one stored chunk per array, Orbax's default)."""
    _check_tree(params, abstract_params(config, jax.tree.leaves(params)[0].dtype), "params to save")
    _check_finite(params, "params to save")
    with atomic_directory(out) as tmp:
        write_checkpoint_files(tmp, hf_config=hf_config or config.to_hf_dict(), params=params,
                               tokenizer_dir=tokenizer_dir, manifest=manifest or {},
                               readme=readme or f"# {config.family} checkpoint\n\n{json.dumps(config.to_hf_dict())}\n",
                               chunk_bytes=chunk_bytes)
    return Path(out)


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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}/manifest.json is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}/manifest.json must hold a JSON object, not a {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}/manifest.json has format {manifest.get('format')!r}; expected {FORMAT!r}")
    files = manifest.get("params_files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values())):
        raise CheckpointError(f"{path}/manifest.json has a malformed params_files (expected "
                              '{"relative/path": {"bytes": int, "sha256": hex}})')
    return manifest


# ---------------------------------------------------------------- content hashes of params/
# A file's digest is the sha256 of the sequence of its 64 MiB chunks' sha256 digests: the chunks
# hash in parallel (hashlib releases the GIL), so verifying a large file is not one core's job.

PARAMS_DIGEST = "sha256 over the sha256 of each 64 MiB chunk"
_CHUNK = 1 << 26


def _params_files(params_dir: Path) -> list[Path]:
    return sorted(p for p in Path(params_dir).rglob("*") if p.is_file())


def params_file_records(params_dir: str | Path) -> dict[str, dict]:
    """{path relative to params/: {"bytes": size, "sha256": digest}} for every file under params/.

    Every chunk of every file is one task on a thread pool (Orbax writes many files of uneven
    size), so all cores hash until the last chunk.
    """
    params_dir = Path(params_dir)
    files = _params_files(params_dir)
    sizes = [f.stat().st_size for f in files]
    tasks = [(i, offset) for i, size in enumerate(sizes) for offset in range(0, size, _CHUNK)]
    fds: list[int] = []
    try:
        fds = [os.open(f, os.O_RDONLY) for f in files]
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(lambda t: hashlib.sha256(os.pread(fds[t[0]], _CHUNK, t[1])).digest(), tasks))
    finally:
        for fd in fds:
            os.close(fd)
    outer = [hashlib.sha256() for _ in files]
    for (i, _), digest in zip(tasks, digests):
        outer[i].update(digest)
    return {f.relative_to(params_dir).as_posix(): {"bytes": size, "sha256": h.hexdigest()}
            for f, size, h in zip(files, sizes, outer)}


def hash_params_files(params_dir: str | Path) -> dict[str, str]:
    """The digest of every file under params/, by path relative to it."""
    return {k: v["sha256"] for k, v in params_file_records(params_dir).items()}


def fingerprint_of(file_hashes: Mapping[str, str]) -> str:
    """One hex digest naming the parameter contents (independent of where the directory lives)."""
    return hashlib.sha256("".join(f"{k}\t{v}\n" for k, v in sorted(file_hashes.items())).encode()).hexdigest()


def params_fingerprint(path: str | Path) -> str:
    """Content fingerprint of a checkpoint's parameters: the one manifest.json recorded when the
    checkpoint was written, else computed now from the files under params/."""
    manifest = read_manifest(path)
    recorded = manifest.get("params_fingerprint")
    if isinstance(recorded, str) and recorded:
        return recorded
    return fingerprint_of(hash_params_files(Path(path) / "params"))


def check_params_layout(params_dir: Path, recorded: Mapping[str, Mapping]) -> None:
    """The files under params/ against manifest.json: the same names and sizes (cheap: no reading)."""
    found = {f.relative_to(params_dir).as_posix(): f for f in _params_files(params_dir)}
    problems = [f"params/{k} is missing" for k in sorted(recorded.keys() - found.keys())]
    problems += [f"params/{k} is not in manifest.json" for k in sorted(found.keys() - recorded.keys())]
    for k in sorted(recorded.keys() & found.keys()):
        size, want = found[k].stat().st_size, recorded[k]["bytes"]
        if size != want:
            state = "truncated" if size < want else "longer than recorded"
            problems.append(f"params/{k} is {state} ({size} bytes, manifest.json recorded {want})")
    if problems:
        raise CheckpointError(f"{params_dir.parent}: " + "; ".join(problems))


def check_params_content(params_dir: Path, recorded: Mapping[str, Mapping]) -> None:
    """The files under params/ hash to what manifest.json recorded."""
    actual = hash_params_files(params_dir)
    bad = [k for k in sorted(recorded) if actual.get(k) != recorded[k]["sha256"]]
    if bad:
        raise CheckpointError(
            f"{params_dir.parent}: " + ", ".join(f"params/{k}" for k in bad) + " does not match the sha256 "
            "recorded in manifest.json (corrupted or replaced); convert again, or load(verify=False) to skip "
            "this check")


def _check_finite(params: Params, what: str) -> None:
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


def load(path: str | Path, dtype: str | Any = "bfloat16", verify: bool = True, mesh=None,
         agree: Callable[[Callable[[], Any], str], Any] | None = None) -> Model:
    """Restore a checkpoint directory with Orbax, straight into `dtype`: on one local device, or, with
    `mesh` (localleap_jax.partition.make_mesh), straight into each parameter's shards on the mesh.

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
    path = Path(path).expanduser().resolve()
    opened = agree(lambda: _open_checkpoint(path, dtype, verify), f"opening {path}")
    params = agree(lambda: _restore(opened, mesh), f"reading {path}/params")
    _check_finite(params, f"{path}/params")  # the same verdict on every process
    tokenizer = agree(lambda: _tokenizer_of(path, opened.config), f"reading {path}'s tokenizer")
    return Model(opened.config, params, tokenizer, path)


@dataclasses.dataclass(frozen=True)
class _Opened:
    """A checkpoint directory whose manifest, config and parameter layout have been checked."""

    path: Path
    config: ModelConfig
    dtype: jnp.dtype
    expected: Params  # shapes and dtypes, from config.json
    recorded: Mapping[str, Mapping] | None  # manifest.json's per-file hashes
    verify: bool


def _open_checkpoint(path: Path, dtype, verify: bool) -> _Opened:
    """Everything `load` checks before reading a parameter: cheap, and the same on every process."""
    import orbax.checkpoint as ocp

    manifest = read_manifest(path)
    try:
        config = ModelConfig.from_json_file(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    dtype = parameter_dtype(dtype)
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path} has no params/ directory")
    recorded = manifest.get("params_files")
    if recorded is not None:
        check_params_layout(path / "params", recorded)
    elif verify:
        import warnings
        warnings.warn(f"{path}/manifest.json records no parameter hashes (written by an older version): "
                      "not verified", stacklevel=4)
    try:
        stored = ocp.StandardCheckpointer().metadata(path / "params").item_metadata.tree
    except Exception as e:  # Orbax raises several types for unreadable metadata
        raise CheckpointError(f"{path}/params is not a readable Orbax checkpoint: {e}") from None
    expected = abstract_params(config, dtype)
    _check_tree(stored, expected, f"{path}/params")
    return _Opened(path, config, dtype, expected, recorded, verify)


def _target_shardings(expected: Params, mesh):
    """Where each leaf is restored: its shards on `mesh`, or whole on this process's first device."""
    if mesh is not None:
        return param_shardings(expected, mesh)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # a device this process can address
    return jax.tree.map(lambda _: device, expected)


def _restore(opened: _Opened, mesh) -> Params:
    """Orbax restore into the target shardings, with the files' hashes checked beside it."""
    import orbax.checkpoint as ocp

    path = opened.path
    target = jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, opened.dtype, sharding=sharding),
                          opened.expected, _target_shardings(opened.expected, mesh))
    hash_it = opened.verify and opened.recorded
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
                                  pad_id=config.pad_token_id)
    except TokenizerError as e:
        raise CheckpointError(f"{path}: {e}") from None


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
