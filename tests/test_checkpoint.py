"""Checkpoint integrity: content hashes recorded by the writer and verified by `ll.load`, non-finite and
truncated parameters refused, the directory's mode, and loader inputs that must fail in one clear error."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import localleap_jax as ll
from localleap_jax import checkpoint
from localleap_jax.checkpoint import CheckpointError, fingerprint_of, hash_params_files, params_fingerprint
from localleap_jax.families import write_config


def _largest_params_file(ck: Path) -> Path:
    return max((p for p in (ck / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _chunked_sha256(path: Path, chunk: int = 1 << 26) -> str:
    """Independent transcription of the recorded digest: sha256 over the sha256 of each 64 MiB chunk."""
    outer = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            outer.update(hashlib.sha256(block).digest())
    return outer.hexdigest()


@pytest.fixture
def ck(tmp_path, converted):
    d = tmp_path / "ck"
    shutil.copytree(converted, d)
    return d


def test_manifest_records_every_params_file_and_the_fingerprint(converted):
    manifest = checkpoint.read_manifest(converted)
    files = {p.relative_to(converted / "params").as_posix(): p for p in (converted / "params").rglob("*") if p.is_file()}
    assert set(manifest["params_files"]) == set(files)
    for rel, entry in manifest["params_files"].items():
        assert entry == {"bytes": files[rel].stat().st_size, "sha256": _chunked_sha256(files[rel])}
    assert manifest["params_fingerprint"] == fingerprint_of({k: v["sha256"] for k, v in manifest["params_files"].items()})
    assert params_fingerprint(converted) == manifest["params_fingerprint"]
    assert hash_params_files(converted / "params") == {k: v["sha256"] for k, v in manifest["params_files"].items()}


def test_save_records_them_too_and_the_embedded_model_carries_them(tmp_path, converted):
    model = ll.load(converted, dtype="float32")
    out = checkpoint.save(tmp_path / "saved", model.config, model.params, converted)
    manifest = checkpoint.read_manifest(out)
    assert manifest["params_fingerprint"] == fingerprint_of(hash_params_files(out / "params"))
    embedded = checkpoint.read_manifest(checkpoint.EMBEDDED)
    assert embedded["params_fingerprint"] == fingerprint_of(hash_params_files(checkpoint.EMBEDDED / "params"))
    ll.load(checkpoint.EMBEDDED)  # verifies


def test_corrupted_params_are_refused_naming_the_file(ck):
    victim = _largest_params_file(ck)
    data = bytearray(victim.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = bytes(b ^ 0x5A for b in data[mid:mid + 4096])
    victim.write_bytes(bytes(data))
    rel = victim.relative_to(ck / "params").as_posix()
    with pytest.raises(CheckpointError, match=f"{rel}.*does not match the sha256 recorded"):
        ll.load(ck)


def test_truncated_params_file_is_a_checkpoint_error_naming_it(ck):
    victim = _largest_params_file(ck)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    rel = victim.relative_to(ck / "params").as_posix()
    with pytest.raises(CheckpointError, match=f"{rel} is truncated"):
        ll.load(ck)
    with pytest.raises(CheckpointError, match=rel):  # without hashing, the size check still names it
        ll.load(ck, verify=False)


def test_verify_false_skips_the_hash(ck):
    manifest = json.loads((ck / "manifest.json").read_text())
    rel = next(iter(manifest["params_files"]))
    manifest["params_files"][rel]["sha256"] = "0" * 64  # a wrong record: only hashing notices
    (ck / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not match the sha256 recorded"):
        ll.load(ck)
    assert ll.load(ck, verify=False).config.d_model == 64


def test_non_finite_parameters_are_refused_naming_the_leaf(tmp_path, converted):
    model = ll.load(converted, dtype="float32")
    params = jax.tree.map(lambda a: a, ll.families.stacked_params(model.params, model.config))  # the stored layout
    params["blocks"]["up_proj"]["kernel"] = params["blocks"]["up_proj"]["kernel"].at[1, 3, 5].set(jnp.nan)
    with checkpoint.atomic_directory(tmp_path / "nan") as tmp:  # the plain writer: hashes match the NaN content
        checkpoint.write_checkpoint_files(tmp, hf_config=write_config(model.config), params=params,
                                          tokenizer_dir=converted, manifest={}, readme="")
    with pytest.raises(CheckpointError, match=r"\['blocks'\]\['up_proj'\]\['kernel'\] holds 1 non-finite value"):
        ll.load(tmp_path / "nan")
    with pytest.raises(CheckpointError, match=r"non-finite"):
        checkpoint.save(tmp_path / "nan2", model.config, params, converted)
    assert not (tmp_path / "nan2").exists()


@pytest.mark.parametrize("dtype", ["int8", "int32", "bool", "float64", "complex64", "banana"])
def test_load_takes_only_floating_parameter_dtypes(converted, dtype):
    with pytest.raises(CheckpointError, match=f"dtype {dtype!r}"):
        ll.load(converted, dtype=dtype)


@pytest.mark.parametrize("name", [123, 1.5, ["embedded"]])
def test_a_checkpoint_named_by_something_else_than_text_is_one_line(name):
    """Issue #47: ll.load(123) was a bare TypeError from pathlib."""
    with pytest.raises(CheckpointError, match=r"^a checkpoint is named by a str or Path: a checkpoint directory, "
                                              r"'embedded', .* or a hub id; got \w+ "):
        ll.load(name)
    with pytest.raises(CheckpointError, match=r"^mesh must be a jax Mesh \(ll.make_mesh\(data=..., model=...\)\), got str$"):
        ll.load("embedded", mesh="data=2")


@pytest.mark.parametrize("manifest, expected", [
    ("[]", "manifest.json must hold a JSON object"),
    ('"x"', "manifest.json must hold a JSON object"),
    ('{"format": "localleap-jax-checkpoint/1", "params_files": []}', "params_files"),
])
def test_malformed_manifest_is_one_clear_error(ck, manifest, expected):
    (ck / "manifest.json").write_text(manifest)
    with pytest.raises(CheckpointError, match=expected):
        ll.load(ck)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_written_checkpoints_take_the_umask_mode(tmp_path, converted, mask):
    model = ll.load(converted, dtype="float32")
    old = os.umask(mask)
    try:
        out = checkpoint.save(tmp_path / "saved", model.config, model.params, converted)
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
    assert ((out / "manifest.json").stat().st_mode & 0o777) == 0o666 & ~mask
    assert ((out / "params").stat().st_mode & 0o777) == 0o777 & ~mask


def test_converted_checkpoints_take_the_umask_mode(tmp_path, hf_checkpoint):
    from localleap_jax.convert_hf import convert

    old = os.umask(0o027)  # neither the usual 022 nor mkdtemp's 077: a hard-coded mode cannot pass
    try:
        out = convert(str(hf_checkpoint[0]), str(tmp_path / "out"), progress=False)
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o750
    assert ((out / "manifest.json").stat().st_mode & 0o777) == 0o640
    assert ((out / "params").stat().st_mode & 0o777) == 0o750


def test_an_interrupt_just_after_the_partial_directory_is_made_leaves_nothing(tmp_path, monkeypatch):
    """A Ctrl-C that lands the moment mkdir has made the temporary directory (the conversion test's "copying"
    moment once failed so, in a clean-clone CI run: mkdtemp made it and the interrupt escaped before its name came
    back) unwinds with nothing beside the output; the directory has the plain-mkdir mode, not mkdtemp's 0700."""
    real_mkdir, made = os.mkdir, []

    def mkdir_then_interrupt(path, mode=0o777, **kw):
        real_mkdir(path, mode, **kw)
        if ".partial-" in os.fspath(path):
            made.append(Path(path))
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with checkpoint.atomic_directory(tmp_path / "out"):
            pass
    monkeypatch.undo()
    assert len(made) == 1 and made[0].parent == tmp_path  # the interrupt really came after the directory existed
    assert list(tmp_path.iterdir()) == []

    umask = os.umask(0o022)
    try:
        with checkpoint.atomic_directory(tmp_path / "out") as tmp:
            assert tmp.name.startswith(".out.partial-") and (tmp.stat().st_mode & 0o777) == 0o755
    finally:
        os.umask(umask)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
