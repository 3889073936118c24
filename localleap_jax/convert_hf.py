"""Convert a Hugging Face checkpoint (safetensors) of any family (LLaDA, Dream, SDAR) into a localleap-jax checkpoint.

    convert(src, out, dtype="source", family=None)   # family None: whatever config.json says

SRC is a local directory or a hub id (only safetensors, json and tokenizer files are downloaded).
Remote code is never run and pickle checkpoints (.bin/.pt/.pth) are refused.

Memory: safetensors headers are read first and the whole tensor set is checked against
config.json (missing, duplicate, unexpected names and wrong shapes are reported together)
before any data is read. Then shards are streamed one tensor at a time straight into the
preallocated, layer-stacked output arrays, so peak RAM is about the model size plus its
largest tensor (LLaDA-8B: ~16 GB + 1 GB). Output goes to a temporary directory renamed to
OUT at the end: an interrupted run leaves nothing that `localleap_jax.load` accepts.

The family modules (`localleap_jax.families`) say which tensors a checkpoint holds and where
each goes; everything else here is the same for every family.
"""

from __future__ import annotations

import json
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from localleap_jax.checkpoint import abstract_params, atomic_directory, check_output_path, write_checkpoint_files
from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError, ConversionError, first_line
from localleap_jax.families import FAMILIES, Family, detect, family_of, tensor_map, tied_copies
from localleap_jax.families.target import hf_shape, leaf_of, parts, swap_last
from localleap_jax.hashing import sha256_file

_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}
_OUT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.jinja", "merges.txt"]


# ---------------------------------------------------------------- safetensors, read by hand


@dataclass(frozen=True)
class TensorInfo:
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the shard
    nbytes: int


def read_header(shard: Path) -> dict[str, TensorInfo]:
    try:
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{shard.name} is not a readable safetensors file: {e}") from None
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        begin, end = h["data_offsets"]
        out[name] = TensorInfo(shard, h["dtype"], tuple(h["shape"]), 8 + n + begin, end - begin)
    return out


def read_tensor(info: TensorInfo) -> np.ndarray:
    if info.dtype not in _DTYPES:
        raise ConversionError(f"{info.shard.name}: unsupported tensor dtype {info.dtype}")
    dtype = np.dtype(_DTYPES[info.dtype])
    count = info.nbytes // dtype.itemsize
    arr = np.fromfile(info.shard, dtype=dtype, count=count, offset=info.offset)
    if arr.size != count:
        raise ConversionError(f"{info.shard.name} is truncated")
    return arr.reshape(info.shape)


# ---------------------------------------------------------------- source resolution


def resolve_source(src: str, revision: str | None = None) -> tuple[Path, str]:
    """A local directory holding the checkpoint, and a description of where it came from."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"{src} is a file; SRC must be a directory or a hub id")
        return path.resolve(), str(path.resolve())
    if src.count("/") != 1 or src.startswith((".", "/")):
        raise ConversionError(f"{src} is neither an existing directory nor a hub id like GSAI-ML/LLaDA-8B-Instruct")
    try:
        from huggingface_hub import snapshot_download
        local = snapshot_download(src, revision=revision, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated repo, ...: say which, in one line
        raise ConversionError(f"could not download {src} from the Hugging Face hub ({type(e).__name__}: {first_line(e)}); "
                              "check the id and your connection, or pass a local directory") from None
    return Path(local), f"hf://{src}" + (f"@{revision}" if revision else "")


def read_source_config(local: Path) -> tuple[dict, ModelConfig]:
    """config.json as the converted checkpoint will hold it (completed by the family from the source's other files,
    e.g. a mask id only the tokenizer names), and what it means."""
    try:
        hf_config = json.loads((local / "config.json").read_text())
    except FileNotFoundError:
        raise ConversionError(f"{local} has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{local}/config.json is not valid JSON: {e}") from None
    try:
        if not isinstance(hf_config, dict):
            raise ConfigError(f"config.json must hold a JSON object, not a {type(hf_config).__name__}")
        family = detect(hf_config)
        if family.complete_config is not None:
            hf_config = family.complete_config(local, hf_config)
        return hf_config, family.read(hf_config)
    except ConfigError as e:
        raise ConversionError(str(e)) from None


def find_shards(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConversionError(f"{index} is not a safetensors index: {e}") from None
        shards = sorted({src / f for f in weight_map.values()})
        missing = [s.name for s in shards if not s.exists()]
        if missing:
            raise ConversionError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return shards
    shards = sorted(src.glob("*.safetensors"))
    if shards:
        return shards
    pickles = sorted(p.name for p in src.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ConversionError(f"{src} holds only pickle checkpoints ({', '.join(pickles)}); they can run arbitrary "
                              "code when loaded and are refused: use the safetensors release")
    raise ConversionError(f"no .safetensors files in {src}")


def check_tensors(shards: list[Path], config: ModelConfig) -> tuple[dict[str, TensorInfo], dict[str, TensorInfo]]:
    """Every tensor's location, after checking the whole set against config.json; and the tied copies the checkpoint
    also holds (`families.tied_copies`: an export that did not de-duplicate them), each the shape and dtype of its
    source (their values are compared while converting)."""
    targets = tensor_map(config)
    tied = tied_copies(config)
    found: dict[str, TensorInfo] = {}
    copies: dict[str, TensorInfo] = {}
    duplicates, unexpected, bad_shape, bad_dtype = [], [], [], []
    expected = abstract_params(config)
    ignored = family_of(config).ignored_tensors  # name prefixes of tensors the network does not use
    for shard in shards:
        for name, info in read_header(shard).items():
            if ignored and name.startswith(ignored) and name not in targets:
                continue
            if name in tied:
                if name in copies:
                    duplicates.append(f"{name} (in {copies[name].shard.name} and {shard.name})")
                copies[name] = info
                continue
            if name in found:
                duplicates.append(f"{name} (in {found[name].shard.name} and {shard.name})")
                continue
            found[name] = info
            if info.dtype not in _DTYPES:
                bad_dtype.append(f"{name} has dtype {info.dtype}")
            entry = targets.get(name)
            if entry is None:
                unexpected.append(name)
                continue
            blocks = parts(entry)
            want = [hf_shape(t, expected) for t in blocks]
            if len(blocks) == 1 and blocks[0].rows is None:
                if info.shape != want[0]:
                    bad_shape.append(f"{name} is {list(info.shape)}, config.json implies {list(want[0])}")
                continue
            # a fused tensor: its row blocks must tile its rows (second-to-last axis), each block the shape of its
            # destination
            rows = sorted((t.rows, w) for t, w in zip(blocks, want))
            axis = len(rows[0][1]) - 2
            whole = rows[0][1][:axis] + (sum(w[axis] for _, w in rows),) + rows[0][1][axis + 1:]
            tiles = all(r[0] == sum(w[axis] for _, w in rows[:i]) and r[1] - r[0] == w[axis]
                        for i, (r, w) in enumerate(rows))
            if info.shape != whole or not tiles:
                bad_shape.append(f"{name} is {list(info.shape)}, config.json implies {list(whole)}")
    missing = [n for n in targets if n not in found]
    for name, info in copies.items():
        source = found.get(tied[name])
        if source is not None and (info.shape, info.dtype) != (source.shape, source.dtype):
            bad_shape.append(f"{name} is {info.dtype} {list(info.shape)}, but the tensor it is tied to, {tied[name]}, "
                             f"is {source.dtype} {list(source.shape)}")
    problems = []
    for label, items in (("missing", missing), ("duplicate", duplicates), ("unexpected", unexpected),
                         ("wrong shape", bad_shape),
                         ("not floating point (only BF16, F16, F32 and F64 weights convert)", bad_dtype)):
        if items:
            shown = items[:20] + ([f"... {len(items) - 20} more"] if len(items) > 20 else [])
            problems.append(f"{label}: {', '.join(shown)}")
    if problems:
        raise ConversionError("the checkpoint does not match config.json; " + "; ".join(problems))
    return found, copies


def check_tied_copy(name: str, copy: TensorInfo, source_name: str, source: TensorInfo) -> None:
    """A tied copy must equal its source: the network reads only the source, so a copy that differs would be dropped
    silently from a checkpoint that is not what it claims to be."""
    a, b = read_tensor(copy), read_tensor(source)
    if not np.array_equal(a, b):
        differ = int(np.count_nonzero(a != b))
        raise ConversionError(f"{name} differs from {source_name}, the tensor it is tied to ({differ} of {a.size} "
                              "values): the checkpoint's tied copies disagree; export it with its tied weights equal "
                              "(or without the copies)")


def tokenizer_source(local: Path, config: ModelConfig, workdir: Path) -> Path:
    """The directory whose tokenizer files the checkpoint gets: the source's own when it has a fast tokenizer
    (tokenizer.json), else one the family builds into `workdir` from the source's slow files (Dream's vocab.json +
    merges.txt, with transformers' own Qwen2 class: no remote code)."""
    if (local / "tokenizer.json").exists():
        return local
    family = family_of(config)
    if family.build_tokenizer is not None:
        try:
            if family.build_tokenizer(local, workdir):
                return workdir
        except Exception as e:  # a broken vocab/merges/tokenizer_config: name the directory, one line
            raise ConversionError(f"could not build a tokenizer from {local}'s {family.slow_tokenizer_files} "
                                  f"({type(e).__name__}: {first_line(e)})") from None
    wanted = f"tokenizer.json (or {family.slow_tokenizer_files})" if family.slow_tokenizer_files else "tokenizer.json"
    raise ConversionError(f"{local} has no {wanted}")


def check_tokenizer(tokenizer_dir: Path, config: ModelConfig) -> None:
    """The tokenizer knows the config's special ids and every id it can produce has an embedding row."""
    from localleap_jax.tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.from_dir(tokenizer_dir, mask_id=config.mask_token_id, eos_id=config.eos_token_id,
                                 pad_id=config.pad_token_id)
    except TokenizerError as e:
        raise ConversionError(str(e)) from None
    if tok.vocab_size > config.embedding_size:
        raise ConversionError(f"the tokenizer has {tok.vocab_size} ids but config.json gives the model only "
                              f"{config.embedding_size} embedding rows")


# ---------------------------------------------------------------- conversion


def convert(src: str, out: str, dtype: str = "source", revision: str | None = None, progress: bool = True,
            family: str | None = None) -> Path:
    """Convert SRC (HF dir or hub id) into the checkpoint directory OUT. With `family` (a family's name) given, a
    source of another family is refused (one line naming what it is)."""
    if family is not None and family not in FAMILIES:
        raise ConversionError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    check_output_path(out)  # before a download, not after
    local, source = resolve_source(src, revision)
    hf_config, config = read_source_config(local)
    found: Family = family_of(config)
    if family is not None and found.name != family:
        raise ConversionError(
            f"{src} is a {found.title} checkpoint (config.json model_type={hf_config.get('model_type')!r}), not "
            f"{family_of(family).title}: convert it without --family (python -m convert SRC OUT detects the family)")
    with tempfile.TemporaryDirectory(prefix="localleap-tokenizer-") as work:
        tokenizer_dir = tokenizer_source(local, config, Path(work))
        check_tokenizer(tokenizer_dir, config)
        shards = find_shards(local)
        tensors, copies = check_tensors(shards, config)
        tied = tied_copies(config)

        source_dtypes = {t.dtype for t in tensors.values()}
        if dtype == "source":
            if len(source_dtypes) != 1:
                raise ConversionError(f"tensors have mixed dtypes {sorted(source_dtypes)}; pass --dtype")
            if source_dtypes == {"F64"}:
                raise ConversionError(f"{src} holds F64 tensors; pass --dtype float32 or --dtype bfloat16 "
                                      "(float64 parameters are not supported)")
            out_dtype = np.dtype(_DTYPES[source_dtypes.pop()])
        elif dtype in _OUT_DTYPES:
            out_dtype = np.dtype(_OUT_DTYPES[dtype])
        else:
            raise ConversionError(f"--dtype {dtype!r} is not one of source, {', '.join(_OUT_DTYPES)}")

        import jax
        targets = tensor_map(config)
        params = jax.tree.map(lambda a: np.empty(a.shape, out_dtype), abstract_params(config))
        shard_sums = []
        with atomic_directory(out) as tmp:
            bar = tqdm(total=sum(t.nbytes for t in (*tensors.values(), *copies.values())), unit="B", unit_scale=True,
                       desc="convert", disable=not progress)
            for shard in shards:  # one shard at a time, one tensor at a time
                for name, info in copies.items():  # read to be compared, never stored
                    if info.shard == shard:
                        check_tied_copy(name, info, tied[name], tensors[tied[name]])
                        bar.update(info.nbytes)
                for name, info in tensors.items():
                    if info.shard != shard:
                        continue
                    src_arr = read_tensor(info)
                    non_finite = src_arr.size - int(np.count_nonzero(np.isfinite(src_arr)))
                    if non_finite:
                        raise ConversionError(f"{name} holds {non_finite} non-finite value(s) (NaN/inf) in {shard.name}")
                    for tgt in parts(targets[name]):
                        dst = leaf_of(params, tgt)
                        block = src_arr if tgt.rows is None else src_arr[..., tgt.rows[0]:tgt.rows[1], :]
                        np.copyto(dst, swap_last(block) if tgt.transpose else block,
                                  casting="unsafe")
                        narrower = ml_dtypes.finfo(out_dtype).max < ml_dtypes.finfo(src_arr.dtype).max
                        if narrower and not np.isfinite(dst).all():  # a value beyond the target dtype's range
                            raise ConversionError(f"{name} overflows {out_dtype.name} (values beyond its range)")
                    del src_arr
                    bar.update(info.nbytes)
                shard_sums.append({"file": shard.name, "sha256": sha256_file(shard), "bytes": shard.stat().st_size})
            bar.close()
            num_params = int(sum(a.size for a in jax.tree.leaves(params)))
            params = _to_device_one_leaf_at_a_time(params)
            manifest = {"source": source, "family": config.family, "converter": "localleap_jax.convert_hf",
                        "shards": shard_sums, "num_params": num_params}
            readme = (f"# {source}\n\nA {found.title} checkpoint converted by "
                      f"`python -m convert` to a localleap-jax checkpoint ({out_dtype.name}). "
                      "Load with `localleap_jax.load(path)`.\nShard hashes are in manifest.json.\n")
            write_checkpoint_files(tmp, hf_config=hf_config, params=params, tokenizer_dir=tokenizer_dir,
                                   manifest=manifest, readme=readme)
    return Path(out)


def _to_device_one_leaf_at_a_time(tree: dict) -> dict:
    """NumPy leaves -> jax.Arrays in place, each NumPy leaf freed as soon as it is copied (peak: +1 leaf).

    Orbax serialises jax.Arrays without the extra host copies it makes of NumPy inputs.
    """
    import jax

    for key, value in tree.items():
        if isinstance(value, dict):
            _to_device_one_leaf_at_a_time(value)
        else:
            tree[key] = jax.block_until_ready(jax.device_put(value))  # drops the NumPy leaf
    return tree
