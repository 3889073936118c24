"""Every bad converter input through the real command line: exit status 2, exactly one line `error: ...`
naming the offending flag, file or field, and no output directory (nor a partial one) left behind.
Also: Ctrl-C at several moments of a conversion, inside Orbax's write included, leaves nothing."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import localleap_jax as ll
from conftest import REPO, write_hf_checkpoint


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _edit_config(key, value=None, delete=False):
    def mutate(src: Path):
        cfg = json.loads((src / "config.json").read_text())
        if delete:
            del cfg[key]
        else:
            cfg[key] = value
        (src / "config.json").write_text(json.dumps(cfg))
    return mutate


def _write(name, text):
    return lambda src: (src / name).write_text(text)


def _retype_tensors(dtype, only=None):
    """Rewrite the source's shards with every tensor (or just `only`) stored as `dtype`."""
    def mutate(src: Path):
        from safetensors.torch import load_file, save_file
        for shard in sorted(src.glob("*.safetensors")):
            tensors = load_file(str(shard))
            save_file({k: (v.to(dtype) if only in (None, k) else v) for k, v in tensors.items()}, str(shard))
    return mutate


def _poison(name):
    def mutate(src: Path):
        from safetensors.torch import load_file, save_file
        for shard in sorted(src.glob("*.safetensors")):
            tensors = load_file(str(shard))
            if name in tensors:
                tensors[name][0, 0] = float("nan")
                save_file(tensors, str(shard))
    return mutate


LLADA_CASES = [
    # (case id, mutation of the LLaDA source, extra args, text the one error line must hold)
    ("d_model-string", _edit_config("d_model", "sixty-four"), [], "d_model='sixty-four' must be an integer"),
    ("d_model-float", _edit_config("d_model", 64.7), [], "d_model=64.7 must be an integer"),
    ("n_layers-list", _edit_config("n_layers", [3]), [], "n_layers=[3] must be an integer"),
    ("no-vocab_size", _edit_config("vocab_size", delete=True), [], "config.json is missing vocab_size"),
    ("config-list", _write("config.json", "[1, 2]"), [], "config.json must hold a JSON object, not a list"),
    ("config-not-json", _write("config.json", "{d_model: 64"), [], "config.json is not valid JSON"),
    ("eos-outside", _edit_config("eos_token_id", 100000), [], "eos_token_id=100000 is outside the vocabulary"),
    ("mask-negative", _edit_config("mask_token_id", -1), [], "mask_token_id=-1 must be >= 0"),
    ("eos-list", _edit_config("eos_token_id", [3, 4]), [], "eos_token_id=[3, 4] must be an integer"),
    ("rope_theta-negative", _edit_config("rope_theta", -5.0), [], "rope_theta=-5.0 must be a positive number"),
    ("rope_scaling", _edit_config("rope_scaling", {"type": "linear", "factor": 2.0}), [], "rope_scaling"),
    ("no-affine-norm", _edit_config("layer_norm_with_affine", False), [], "layer_norm_with_affine"),
    ("norm-bias", _edit_config("bias_for_layer_norm", True), [], "bias_for_layer_norm"),
    ("block_type-missing", _edit_config("block_type", delete=True), [], "block_type"),
    ("all-F64", _retype_tensors(torch.float64), [], "F64 tensors; pass --dtype float32 or --dtype bfloat16"),
    ("I32-tensor", _retype_tensors(torch.int32, only="model.transformer.ln_f.weight"), [],
     "model.transformer.ln_f.weight has dtype I32"),
    ("nan-tensor", _poison("model.transformer.blocks.1.up_proj.weight"), [],
     "model.transformer.blocks.1.up_proj.weight holds 1 non-finite value"),
    ("bad-dtype-flag", None, ["--dtype", "int8"], "--dtype"),
    ("unknown-flag", None, ["--fast"], "--fast"),
    ("no-tokenizer", lambda src: (src / "tokenizer.json").unlink(), [], "has no tokenizer.json"),
]
DREAM_CASES = [
    ("sliding-window", _edit_config("use_sliding_window", True), [], "use_sliding_window"),
    ("dream-rope_scaling", _edit_config("rope_scaling", {"type": "yarn", "factor": 4.0}), [], "rope_scaling"),
    ("heads-string", _edit_config("num_attention_heads", "14"), [], "num_attention_heads='14' must be an integer"),
    ("tied-head", _edit_config("tie_word_embeddings", True), [], "tie_word_embeddings"),
    ("pad-outside", _edit_config("pad_token_id", 320), [], "pad_token_id=320 is outside the vocabulary"),
]


@pytest.mark.parametrize("family, case, mutate, extra, expected",
                         [("llada", *c) for c in LLADA_CASES] + [("dream", *c) for c in DREAM_CASES],
                         ids=[c[0] for c in LLADA_CASES + DREAM_CASES])
def test_bad_input_is_one_error_line_and_leaves_nothing(request, tmp_path, family, case, mutate, extra, expected):
    fixture = "hf_checkpoint" if family == "llada" else "dream_hf_checkpoint"
    src = tmp_path / "src"
    shutil.copytree(request.getfixturevalue(fixture)[0], src)
    if mutate is not None:
        mutate(src)
    r = _run("-m", f"convert.{family}", src, tmp_path / "out", "--quiet", *extra)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert expected in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no OUT, no .out.partial-*


@pytest.mark.parametrize("where, expected", [
    ("file", "is a file"),
    ("unwritable", "cannot write"),
    ("missing-src", "is neither an existing directory nor a hub id"),
])
def test_bad_paths_are_one_error_line(tmp_path, hf_checkpoint, where, expected):
    src, out = hf_checkpoint[0], tmp_path / "out"
    if where == "file":
        out.write_text("mine")
    elif where == "unwritable":
        out = Path("/sys/localleap-test-out") if os.geteuid() == 0 else tmp_path / "ro" / "out"
        if os.geteuid() != 0:
            (tmp_path / "ro").mkdir(mode=0o555)
    else:
        src = tmp_path / "nowhere"
    r = _run("-m", "convert.llada", src, out, "--quiet")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], r.stderr
    assert str(src if where == "missing-src" else out) in lines[0]
    if where == "file":
        assert out.read_text() == "mine"
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


def test_an_f64_source_converts_with_an_explicit_dtype(tmp_path, hf_checkpoint):
    src = tmp_path / "src"
    shutil.copytree(hf_checkpoint[0], src)
    _retype_tensors(torch.float64)(src)
    r = _run("-m", "convert.llada", src, tmp_path / "out", "--quiet", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    model = ll.load(tmp_path / "out", dtype="float32")
    q = hf_checkpoint[2]["model.transformer.blocks.1.q_proj.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(model.params["blocks"]["q_proj"]["kernel"][1]), q.T)


# ---------------------------------------------------------------- Ctrl-C at any moment


@pytest.fixture(scope="module")
def big_source(tmp_path_factory, tiny_tokenizer):
    """A ~110 MB fp32 LLaDA-layout checkpoint: big enough that Orbax's write takes a noticeable time."""
    from conftest import tiny_hf_config

    tok = tiny_tokenizer
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id, d_model=512, n_heads=8, n_kv_heads=8,
                         n_layers=8, mlp_hidden_size=1536)
    rng = np.random.default_rng(0)
    d, f, v = 512, 1536, cfg["embedding_size"]
    shapes = {"model.transformer.wte.weight": (v, d), "model.transformer.ln_f.weight": (d,),
              "model.transformer.ff_out.weight": (v, d)}
    for i in range(8):
        b = f"model.transformer.blocks.{i}."
        shapes |= {b + "attn_norm.weight": (d,), b + "ff_norm.weight": (d,), b + "q_proj.weight": (d, d),
                   b + "k_proj.weight": (d, d), b + "v_proj.weight": (d, d), b + "attn_out.weight": (d, d),
                   b + "ff_proj.weight": (f, d), b + "up_proj.weight": (f, d), b + "ff_out.weight": (d, f)}
    tensors = {k: torch.from_numpy(rng.standard_normal(s, dtype=np.float32) * 0.02) for k, s in shapes.items()}
    return write_hf_checkpoint(tmp_path_factory.mktemp("big") / "src", cfg, tensors, tok, n_shards=2)


def _partial_dirs(parent: Path):
    return list(parent.glob(".out.partial-*"))


def _stage(parent: Path) -> str:
    """How far the conversion writing into `parent` has got, from what its partial directory holds."""
    partial = _partial_dirs(parent)
    if not partial:
        return "no output yet"
    names = {p.name for p in partial[0].iterdir()} if partial[0].exists() else set()
    if "params" in names:  # Orbax renames its own temporary directory to params/ when it is done
        return "after the orbax write"
    if any(n.startswith("params") for n in names):
        return "inside the orbax write"
    return "copying tensors"


# moment -> (stage to wait for, extra delay before SIGINT)
MOMENTS = {
    "startup": ("no output yet", 0.3),
    "copying": ("copying tensors", 0.0),
    "orbax-write": ("inside the orbax write", 0.0),
    "orbax-write+0.1s": ("inside the orbax write", 0.1),
    "after-orbax": ("after the orbax write", 0.0),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_at_any_moment_leaves_no_partial_directory(tmp_path, big_source, moment):
    stage, delay = MOMENTS[moment]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "convert.llada", str(big_source), str(out), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while proc.poll() is None and _stage(tmp_path) != stage and time.monotonic() - t0 < 120:
        time.sleep(0.001)
    reached = _stage(tmp_path)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    time.sleep(1.0)  # anything still writing in the background would show up now
    leftovers = _partial_dirs(tmp_path)
    assert not leftovers, f"left behind: {leftovers} (exit {proc.returncode}): {err[-2000:]}"
    if moment in ("startup", "copying", "orbax-write"):
        assert reached == stage  # the interrupt really came at that moment...
    if proc.returncode == 0:  # ...or, for the later moments, it may land after the rename: then OUT is whole
        assert moment not in ("startup", "copying", "orbax-write"), err
        ll.load(out, dtype="float32")
    else:
        assert not out.exists()
        assert proc.returncode == 130, err[-2000:]
        assert err.strip().splitlines() in ([f"error: interrupted; nothing was written to {out}"],
                                            ["error: interrupted before anything was written"]), err[-2000:]
