"""Convert a Hugging Face LLaDA checkpoint (safetensors) into a localleap-jax checkpoint directory.

    python -m convert.llada SRC OUT [--dtype bfloat16|float32|float16|source]

SRC is a local directory or a hub id (e.g. GSAI-ML/LLaDA-8B-Instruct; only safetensors, json
and tokenizer files are downloaded). Remote code is never run and pickle checkpoints
(.bin/.pt/.pth) are refused.

Memory: safetensors headers are read first and the whole tensor set is checked against
config.json (missing, duplicate, unexpected names and wrong shapes are reported together)
before any data is read. Then shards are streamed one tensor at a time straight into the
preallocated, layer-stacked output arrays, so peak RAM is about the model size plus its
largest tensor (LLaDA-8B: ~16 GB + 1 GB). Output goes to a temporary directory renamed to
OUT at the end: an interrupted run leaves nothing that `localleap_jax.load` accepts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from localleap_jax.checkpoint import CheckpointError, abstract_params, atomic_directory, write_checkpoint_files
from localleap_jax.config import ConfigError, ModelConfig

_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.jinja"]


class ConversionError(RuntimeError):
    """Anything about the source that stops a faithful conversion; the message says what."""


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: a leaf of the Flax tree, a layer slot (or None), transposed or not."""

    path: tuple[str, ...]
    layer: int | None
    transpose: bool


_BLOCK_NAME = re.compile(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.weight")
_LINEAR = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
_NORMS = ("attn_norm", "ff_norm")


def target_of(name: str, n_layers: int) -> Target | None:
    """The Flax destination of a LLaDA tensor name; None if the name is not part of LLaDA."""
    if name == "model.transformer.wte.weight":
        return Target(("wte", "embedding"), None, False)
    if name == "model.transformer.ln_f.weight":
        return Target(("ln_f", "scale"), None, False)
    if name == "model.transformer.ff_out.weight":
        return Target(("ff_out", "kernel"), None, True)  # [V, D] -> [D, V]
    m = _BLOCK_NAME.fullmatch(name)
    if m and int(m[1]) < n_layers:
        if m[2] in _LINEAR:
            return Target(("blocks", m[2], "kernel"), int(m[1]), True)  # PyTorch [out, in] -> x @ W
        if m[2] in _NORMS:
            return Target(("blocks", m[2], "scale"), int(m[1]), False)
    return None


def expected_names(n_layers: int) -> list[str]:
    top = ["model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"]
    return top + [f"model.transformer.blocks.{i}.{k}.weight" for i in range(n_layers) for k in (*_NORMS, *_LINEAR)]


def llada_tensors(params, n_layers: int) -> dict:
    """The inverse mapping: LLaDA-named tensors ([out, in] like PyTorch) from a Flax tree, for the
    PyTorch reference path of the benchmarks. Arrays stay whatever type the tree holds (numpy, jax)."""
    out = {}
    for name in expected_names(n_layers):
        tgt = target_of(name, n_layers)
        leaf = params
        for k in tgt.path:
            leaf = leaf[k]
        arr = leaf if tgt.layer is None else leaf[tgt.layer]
        out[name] = arr.T if tgt.transpose else arr
    return out


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


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"could not download {src} from the Hugging Face hub ({type(e).__name__}: {reason}); "
                              "check the id and your connection, or pass a local directory") from None
    return Path(local), f"hf://{src}" + (f"@{revision}" if revision else "")


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


def check_tensors(shards: list[Path], config: ModelConfig) -> dict[str, TensorInfo]:
    """Every tensor's location, after checking the whole set against config.json."""
    found: dict[str, TensorInfo] = {}
    duplicates, unexpected, bad_shape = [], [], []
    expected = abstract_params(config)
    for shard in shards:
        for name, info in read_header(shard).items():
            if name in found:
                duplicates.append(f"{name} (in {found[name].shard.name} and {shard.name})")
                continue
            found[name] = info
            tgt = target_of(name, config.n_layers)
            if tgt is None:
                unexpected.append(name)
                continue
            leaf = expected
            for k in tgt.path:
                leaf = leaf[k]
            want = leaf.shape[1:] if tgt.layer is not None else leaf.shape
            want = tuple(reversed(want)) if tgt.transpose else tuple(want)
            if info.shape != want:
                bad_shape.append(f"{name} is {list(info.shape)}, config.json implies {list(want)}")
    missing = [n for n in expected_names(config.n_layers) if n not in found]
    problems = []
    for label, items in (("missing", missing), ("duplicate", duplicates), ("unexpected", unexpected),
                         ("wrong shape", bad_shape)):
        if items:
            shown = items[:20] + ([f"... {len(items) - 20} more"] if len(items) > 20 else [])
            problems.append(f"{label}: {', '.join(shown)}")
    if problems:
        raise ConversionError("the checkpoint does not match config.json; " + "; ".join(problems))
    return found


# ---------------------------------------------------------------- conversion


def convert(src: str, out: str, dtype: str = "source", revision: str | None = None, progress: bool = True) -> Path:
    local, source = resolve_source(src, revision)
    try:
        hf_config = json.loads((local / "config.json").read_text())
    except FileNotFoundError:
        raise ConversionError(f"{local} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{local}/config.json is not valid JSON: {e}") from None
    try:
        config = ModelConfig.from_hf_dict(hf_config)
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    if not (local / "tokenizer.json").exists():
        raise ConversionError(f"{local} has no tokenizer.json")
    shards = find_shards(local)
    tensors = check_tensors(shards, config)

    source_dtypes = {t.dtype for t in tensors.values()}
    if dtype == "source":
        if len(source_dtypes) != 1:
            raise ConversionError(f"tensors have mixed dtypes {sorted(source_dtypes)}; pass --dtype")
        out_dtype = np.dtype(_DTYPES[source_dtypes.pop()])
    else:
        out_dtype = np.dtype({"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype])

    import jax
    params = jax.tree.map(lambda a: np.empty(a.shape, out_dtype), abstract_params(config))
    shard_sums = []
    with atomic_directory(out) as tmp:
        bar = tqdm(total=sum(t.nbytes for t in tensors.values()), unit="B", unit_scale=True, desc="convert",
                   disable=not progress)
        for shard in shards:  # one shard at a time, one tensor at a time
            for name, info in tensors.items():
                if info.shard != shard:
                    continue
                tgt = target_of(name, config.n_layers)
                leaf = params
                for k in tgt.path:
                    leaf = leaf[k]
                dst = leaf if tgt.layer is None else leaf[tgt.layer]
                src_arr = read_tensor(info)
                np.copyto(dst, src_arr.T if tgt.transpose else src_arr, casting="unsafe")
                del src_arr
                bar.update(info.nbytes)
            shard_sums.append({"file": shard.name, "sha256": sha256_of(shard), "bytes": shard.stat().st_size})
        bar.close()
        num_params = int(sum(a.size for a in jax.tree.leaves(params)))
        params = _to_device_one_leaf_at_a_time(params)
        manifest = {"source": source, "converter": "convert/llada.py", "shards": shard_sums,
                    "num_params": num_params}
        readme = (f"# {source}\n\nConverted by `python -m convert.llada` to a localleap-jax checkpoint "
                  f"({out_dtype.name}). Load with `localleap_jax.load(path)`.\nShard hashes are in manifest.json.\n")
        write_checkpoint_files(tmp, hf_config=hf_config, params=params, tokenizer_dir=local, manifest=manifest,
                               readme=readme)
    return Path(out)


CACHE_DIR = Path("~/.cache/localleap_jax/checkpoints").expanduser()


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m convert.llada", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="local HF checkpoint directory or hub id")
    ap.add_argument("out", help="output checkpoint directory (must not exist or be empty)")
    ap.add_argument("--dtype", default="source", choices=("source", "bfloat16", "float16", "float32"),
                    help="parameter dtype to store (default: the source's, bf16 for LLaDA)")
    ap.add_argument("--revision", help="hub revision (branch, tag or commit)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        out = convert(args.src, args.out, args.dtype, args.revision, progress=not args.quiet)
    except (ConversionError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
