"""Writing checkpoint directories: everything goes into a sibling temporary directory that is renamed into place
at the end, so an interrupted write leaves nothing that `load` accepts (and, Ctrl-C included, nothing at all).
Non-finite parameters are refused before anything is written."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax

from localleap_jax import cli
from localleap_jax.checkpoint.manifest import FORMAT, PARAMS_DIGEST, fingerprint_of, params_file_records
from localleap_jax.checkpoint.reading import abstract_params, check_finite, check_tree
from localleap_jax.families import stacked_params
from localleap_jax.config import ModelConfig
from localleap_jax.errors import CheckpointError
from localleap_jax.families import write_config
from localleap_jax.model import Params
from localleap_jax.partition import expert_split_axis, model_split_axis, path_names
from localleap_jax.tokenizer import TOKENIZER_FILES


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
        # A command's watchdog that ends the program (a Ctrl-C while a compiled call runs) removes it first.
        with cli.if_abandoned(lambda: _remove_tree(tmp)):
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
    """Orbax SaveArgs per leaf: chunks of at most `chunk_bytes`, cut first along the dimension a mesh splits (a
    routed expert's expert dimension, partition.expert_split_axis; else the model axis', model_split_axis). None: one
    chunk per array."""
    import orbax.checkpoint as ocp

    def save_args(keypath, leaf):
        path, shape = path_names(keypath), tuple(leaf.shape)
        axis = expert_split_axis(path, shape)
        axis = model_split_axis(path, shape) if axis is None else axis
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
    CHUNK_BYTES (None: one stored chunk per array, Orbax's default). `params` in either layout (a loaded model's is
    stacked back: checkpoints store each run of layers stacked)."""
    params = stacked_params(params, config)
    check_tree(params, abstract_params(config, jax.tree.leaves(params)[0].dtype), "params to save")
    check_finite(params, "params to save")
    with atomic_directory(out) as tmp:
        write_checkpoint_files(tmp, hf_config=hf_config or write_config(config), params=params,
                               tokenizer_dir=tokenizer_dir, manifest=manifest or {},
                               readme=readme or f"# {config.family} checkpoint\n\n{json.dumps(write_config(config))}\n",
                               chunk_bytes=chunk_bytes)
    return Path(out)


