"""manifest.json, the completion mark of a checkpoint directory, and the content hashes of params/ it records.

A file's digest is the sha256 of the sequence of its 64 MiB chunks' sha256 digests: the chunks hash in parallel
(hashlib releases the GIL), so verifying a large file is not one core's job.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

from localleap_jax.errors import CheckpointError

FORMAT = "localleap-jax-checkpoint/1"


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


