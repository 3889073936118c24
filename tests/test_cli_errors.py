"""Every bad input through the real command lines: exit status 2, exactly one line `error: ...` naming the
offending flag, file or field, no traceback, and nothing left behind (no output, no partial directory).

Converter (`python -m convert ...`): one table per family, bad paths, and Ctrl-C at several moments of a
conversion, inside Orbax's write included.

Evaluation (`experiments/eval_gsm8k.py`, `python -m localleap_jax.lm_eval`): one table, ROWS, of
(name, command, error). A failure before lm-eval starts prints that line alone; once lm-eval runs, its
logging and progress bars come before it. `command` starts with a program alias from PROGRAMS and may use
{tmp} (a directory of prepared inputs, see `inputs`) and {out} (a path no row creates); eval_gsm8k rows get
`--output {out}` unless they name their own. `error` is a regular expression searched in the line after
"error: ". After every row, {out} does not exist and nothing under {tmp} changed.

How a row runs. The command line's own entry (`convert.main`, `eval_gsm8k.main`, the adapter's `main`:
what `python PROGRAM ...` calls) runs the row's argv in this process, its stderr captured at the file
descriptor (`in_process`): the exit status is what the interpreter would exit with (main's return value or
its SystemExit), an exception escaping main fails the test (that is a traceback), warnings print to stderr
under Python's default filters as they would in the program, and what a run changes in the process
(sys.argv, signal handlers, the environment, JAX's persistent-cache settings, lm-eval's logging, the random
generators) is put back after it. A few rows run as the real program in a process of their own
(`REAL_PROCESS`, `_python`): one or two per program, so that the real entry point is proven to end the same
way, and those that need a process boundary (another process holding --output; Ctrl-C).
"""


import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

import localleap_jax as ll
from helpers import REPO, write_hf_checkpoint


class Ran(NamedTuple):
    returncode: int
    stderr: str


def _run(*args, timeout=300, env=None):
    """The real `python ARGS...`, in a process of its own."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env)


def _convert_main(family):
    from convert import main

    return lambda argv: main([*argv, "--family", family])  # what `python -m convert ... --family FAMILY` calls


def _eval_main():
    from localleap_jax.commands import eval_gsm8k

    return eval_gsm8k.main  # `python experiments/eval_gsm8k.py` runs sys.exit(main())


def _adapter_main():
    from localleap_jax.lm_eval import main

    return main  # `python -m localleap_jax.lm_eval` runs sys.exit(main())


def _likelihood_main():
    from localleap_jax.commands import eval_likelihood

    return eval_likelihood.main  # `python experiments/eval_likelihood.py` runs sys.exit(main())


def _dynamics_main():
    from localleap_jax.commands import analyze_dynamics

    return analyze_dynamics.main  # `python experiments/analyze_dynamics.py` runs sys.exit(main())


JAX_CACHE_FLAGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes")


def _python_default_warning_filters():
    """The filters a plain `python` starts with (no -W, no PYTHONWARNINGS), in place of pytest's."""
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__", append=True)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category, append=True)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextmanager
def _process_state_put_back(compile_cache_dir: Path):
    """Whatever a command line's main changes in its process, restored when it returns: this worker runs
    the next test as if main had run elsewhere. The persistent compilation cache, which eval_gsm8k and the
    adapter turn on by default, points at `compile_cache_dir` meanwhile (never at ~/.cache)."""
    import jax

    from localleap_jax import compile_cache

    argv, environ = sys.argv[:], dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    jax_flags = {k: getattr(jax.config, k) for k in JAX_CACHE_FLAGS}
    default_dir, compile_cache.DEFAULT_DIR = compile_cache.DEFAULT_DIR, compile_cache_dir
    rngs = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    root = logging.getLogger()
    root_state = root.handlers[:], root.level
    # Logging as in the program: records that reach the root logger are printed on stderr (absl, imported
    # with Orbax, calls logging.basicConfig() there), not collected by pytest's log capture.
    stderr_handler = logging.StreamHandler(sys.stderr)
    stderr_handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    root.handlers[:] = [stderr_handler]
    root.setLevel(logging.WARNING)
    lm_eval_logger = logging.getLogger("lm_eval")
    logger_state = lm_eval_logger.handlers[:], lm_eval_logger.level, lm_eval_logger.propagate
    lm_eval_utils = sys.modules.get("lm_eval.utils")
    configured = getattr(lm_eval_utils, "_LOGGING_CONFIGURED", False)
    if lm_eval_utils is not None:  # so that setup_logging() gives this run a handler on the captured stderr
        lm_eval_utils._LOGGING_CONFIGURED = False
        lm_eval_logger.handlers[:] = []
    try:
        yield
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
        for s, h in handlers.items():
            signal.signal(s, h)
        compile_cache.DEFAULT_DIR = default_dir
        if {k: getattr(jax.config, k) for k in JAX_CACHE_FLAGS} != jax_flags:
            from jax.experimental.compilation_cache import compilation_cache

            for k, v in jax_flags.items():
                jax.config.update(k, v)
            compilation_cache.reset_cache()  # the next compile reads the settings again
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.random.set_rng_state(rngs[2])
        root.handlers[:] = root_state[0]
        root.setLevel(root_state[1])
        lm_eval_logger.handlers[:], lm_eval_logger.propagate = logger_state[0], logger_state[2]
        lm_eval_logger.setLevel(logger_state[1])
        if "lm_eval.utils" in sys.modules:
            sys.modules["lm_eval.utils"]._LOGGING_CONFIGURED = configured


def in_process(main, argv, capfd, compile_cache_dir) -> Ran:
    """`main(argv)` in this process, ended as the interpreter ends `sys.exit(main())`: its exit status and
    what it wrote to stderr (file descriptor 2 and sys.stderr)."""
    capfd.readouterr()
    with _process_state_put_back(compile_cache_dir), warnings.catch_warnings():
        _python_default_warning_filters()
        warnings.showwarning = _show_warning
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's errors, sys.exit(...)
            code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    return Ran(code, capfd.readouterr().err)


@pytest.fixture(scope="module")
def compile_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xla")


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
    ("mask-equals-eos", lambda src: _edit_config("mask_token_id", json.loads((src / "config.json").read_text())[
        "eos_token_id"])(src), [], "equals mask_token_id: a generated end of text would read as a position "
                                  "still to generate"),
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
    ("dream-pad-equals-mask", lambda src: _edit_config("pad_token_id", json.loads((src / "config.json").read_text())[
        "mask_token_id"])(src), [], "equals mask_token_id: padding would read as positions to generate"),
]


# These rows run as `python -m convert ... --family FAMILY` in a process of their own (one per family).
CONVERT_REAL_PROCESS = {"d_model-string", "pad-outside"}
assert CONVERT_REAL_PROCESS <= {c[0] for c in LLADA_CASES} | {c[0] for c in DREAM_CASES}


@pytest.mark.parametrize("family, case, mutate, extra, expected",
                         [("llada", *c) for c in LLADA_CASES] + [("dream", *c) for c in DREAM_CASES],
                         ids=[c[0] for c in LLADA_CASES + DREAM_CASES])
def test_bad_input_is_one_error_line_and_leaves_nothing(request, tmp_path, capfd, compile_cache_dir, family, case,
                                                       mutate, extra, expected):
    fixture = "hf_checkpoint" if family == "llada" else "dream_hf_checkpoint"
    src = tmp_path / "src"
    shutil.copytree(request.getfixturevalue(fixture)[0], src)
    if mutate is not None:
        mutate(src)
    argv = [src, tmp_path / "out", "--quiet", *extra]
    if case in CONVERT_REAL_PROCESS:
        r = _run("-m", "convert", *argv, "--family", family)
    else:
        r = in_process(_convert_main(family), argv, capfd, compile_cache_dir)
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
def test_bad_paths_are_one_error_line(tmp_path, capfd, compile_cache_dir, hf_checkpoint, where, expected):
    src, out = hf_checkpoint[0], tmp_path / "out"
    if where == "file":
        out.write_text("mine")
    elif where == "unwritable":
        out = Path("/sys/localleap-test-out") if os.geteuid() == 0 else tmp_path / "ro" / "out"
        if os.geteuid() != 0:
            (tmp_path / "ro").mkdir(mode=0o555)
    else:
        src = tmp_path / "nowhere"
    r = in_process(_convert_main("llada"), [src, out, "--quiet"], capfd, compile_cache_dir)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], r.stderr
    assert str(src if where == "missing-src" else out) in lines[0]
    if where == "file":
        assert out.read_text() == "mine"
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


def test_an_f64_source_converts_with_an_explicit_dtype(tmp_path, capfd, compile_cache_dir, hf_checkpoint):
    src = tmp_path / "src"
    shutil.copytree(hf_checkpoint[0], src)
    _retype_tensors(torch.float64)(src)
    r = in_process(_convert_main("llada"), [src, tmp_path / "out", "--quiet", "--dtype", "float32"], capfd,
                   compile_cache_dir)
    assert r.returncode == 0, r.stderr
    model = ll.load(tmp_path / "out", dtype="float32")
    q = hf_checkpoint[2]["model.transformer.blocks.1.q_proj.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(model.params["layers"][1]["q_proj"]["kernel"]), q.T)


# ---------------------------------------------------------------- Ctrl-C at any moment


@pytest.fixture(scope="module")
def big_source(tmp_path_factory, tiny_tokenizer):
    """A ~110 MB fp32 LLaDA-layout checkpoint: big enough that Orbax's write takes a noticeable time."""
    from helpers import tiny_hf_config

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


# A scheduler's SIGTERM and a closed terminal's SIGHUP end a conversion as Ctrl-C does (issue #22): at two moments
# each, the Orbax write (its thread waited for) and tensor copying.
SIGNALS = [(m, "SIGINT") for m in MOMENTS] + [("orbax-write", "SIGTERM"), ("copying", "SIGHUP")]


@pytest.mark.parametrize("moment, signame", SIGNALS, ids=[m if s == "SIGINT" else f"{m}-{s}" for m, s in SIGNALS])
def test_ctrl_c_at_any_moment_leaves_no_partial_directory(tmp_path, big_source, moment, signame):
    stage, delay = MOMENTS[moment]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "convert", str(big_source), str(out), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while proc.poll() is None and _stage(tmp_path) != stage and time.monotonic() - t0 < 120:
        time.sleep(0.001)
    reached = _stage(tmp_path)
    time.sleep(delay)
    proc.send_signal(getattr(signal, signame))
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
        named = "" if signame == "SIGINT" else f" ({signame})"
        assert err.strip().splitlines() in ([f"error: interrupted{named}; nothing was written to {out}"],
                                            ["error: interrupted before anything was written"]), err[-2000:]


# ---------------------------------------------------------------- eval_gsm8k.py and the lm-eval adapter

PROGRAMS = {  # alias -> (the real program's arguments to python, its entry: what that program calls)
    "eval": (["experiments/eval_gsm8k.py"], _eval_main),
    "adapter": (["-m", "localleap_jax.lm_eval"], _adapter_main),
    "likelihood": (["experiments/eval_likelihood.py"], _likelihood_main),
    "dynamics": (["experiments/analyze_dynamics.py"], _dynamics_main),
}
WITH_OUTPUT = ("eval", "likelihood", "dynamics")  # the programs a row gives `--output {out}` unless it names one
ADAPTER = "adapter --model localleap --model_args checkpoint=embedded"

ROWS = [
    # numbers (issue #8 item 1): each is refused before anything is loaded
    ("batch-size-negative", "eval --batch-size -1", r"^argument --batch-size: expected a positive integer, got -1$"),
    ("batch-size-zero", "eval --batch-size 0", r"^argument --batch-size: expected a positive integer"),
    ("batch-size-word", "eval --batch-size many", r"^argument --batch-size: expected a positive integer"),
    ("limit-zero", "eval --limit 0", r"^argument --limit: expected a positive integer, got 0$"),
    ("limit-negative", "eval --limit -1", r"^argument --limit: expected a positive integer"),
    ("limit-fraction", "eval --limit 0.5", r"^argument --limit: expected a positive integer, got '0.5'"),
    ("gen-length-zero", "eval --gen-length 0", r"^argument --gen-length: expected a positive integer"),
    ("block-length-negative", "eval --block-length -16", r"^argument --block-length: expected a positive integer"),
    ("num-fewshot-negative", "eval --num-fewshot -1", r"^argument --num-fewshot: expected an integer >= 0"),
    ("steps-zero", "eval --steps 0", r"^argument --steps: expected a positive integer"),
    ("kappa-above-one", "eval --kappa 1.5", r"^argument --kappa: expected a number in \(0, 1\]"),
    ("kappa-nan", "eval --kappa nan", r"^argument --kappa: expected a number in \(0, 1\]"),
    ("tau-zero", "eval --tau 0", r"^argument --tau: expected a number in \(0, 1\]"),
    ("radius-negative", "eval --radius -1", r"^argument --radius: expected an integer >= 0"),
    ("seed-negative", "eval --seed -3", r"^argument --seed: expected an integer >= 0"),
    ("seed-too-large", "eval --seed 4294967296", r"^argument --seed: expected an integer below 2\*\*32"),
    ("dtype-int8", "eval --dtype int8", r"^argument --dtype: invalid choice: 'int8'"),
    ("cache-unknown", "eval --cache none,fast", r"^--cache fast: unknown cache 'fast'; choose from auto, none, "),
    ("cache-setting", "eval --cache dkv:reload_every=0", r"^--cache dkv:reload_every=0: cache dkv: reload_every=0 must "
                                                         r"lie in \[1, inf\)$"),
    ("strategy-twice", "eval --strategies threshold,threshold", r"^argument --strategies: threshold given twice"),
    ("strategies-empty", "eval --strategies ,", r"^argument --strategies: no names given"),
    ("flag-misspelled", "eval --kapa 0.9", r"unrecognized arguments: --kapa"),
    ("fewshot-data-without-data", "eval --fewshot-data {tmp}/good.jsonl", r"^argument --fewshot-data: needs --data"),
    # the output directory (items 8, 9)
    ("output-is-a-file", "eval --output {tmp}/afile", r"^--output \S*/afile is a file, not a directory$"),
    ("output-under-a-file", "eval --output {tmp}/afile/sub", r"^--output \S*/afile/sub: \S*/afile is a file"),
    ("output-read-only", "eval --output /sys/localleap-eval-out", r"^--output /sys/localleap-eval-out: cannot write there"),
    ("output-held-by-another-run", "eval --output {tmp}/held",
     r"^--output \S*/held is in use by another run \(pid \d+ on .+\); wait for it"),
    # data files (item 9: checked before the output directory exists)
    ("data-missing", "eval --data {tmp}/missing.jsonl", r"^--data \S*/missing.jsonl: no such file$"),
    ("data-is-a-directory", "eval --data {tmp}", r"^--data \S+: is a directory, not a file$"),
    ("data-row-without-keys", "eval --data {tmp}/bad.jsonl", r"^--data \S*/bad.jsonl:2 needs the keys 'question' and 'answer'"),
    ("data-not-json", "eval --data {tmp}/notjson.jsonl", r"^--data \S*/notjson.jsonl:1 is not valid JSON"),
    ("data-empty", "eval --data {tmp}/empty.jsonl", r"^--data \S*/empty.jsonl holds no problems$"),
    ("data-rows-without-a-gold-answer", "eval --data {tmp}/garbled.jsonl",
     r"^--data \S*/garbled.jsonl: 3 of 4 problems cannot be used \(line 2: its answer has no '#### N' \(the gold "
     r"number the scorer reads\); lines 3, 4 too\); fix or remove them$"),
    ("fewshot-data-gold-not-a-number", "eval --data {tmp}/good.jsonl --fewshot-data {tmp}/notanumber.jsonl",
     r"^--fewshot-data \S*/notanumber.jsonl: 1 of 1 problems cannot be used \(line 1: its gold '#### seven' is not "
     r"a number\)"),
    ("fewshot-data-bad", "eval --data {tmp}/good.jsonl --fewshot-data {tmp}/bad.jsonl",
     r"^--fewshot-data \S*/bad.jsonl:2 needs the keys"),
    ("fewshot-examples-too-few", "eval --data {tmp}/good.jsonl --num-fewshot 3",
     r"^--num-fewshot 3: \S*/good.jsonl offers only 2 few-shot examples per problem$"),
    # the checkpoint and the decoding settings
    ("checkpoint-missing", "eval --checkpoint {tmp}/nope", r"no checkpoint at \S*/nope"),
    ("strategy-unknown", "eval --strategies low_confidence,greedy", r"^--strategies greedy: unknown strategy .greedy."),
    ("strategy-setting", "eval --strategies threshold:kapa=0.8", r"^--strategies threshold:kapa=0.8: threshold has no setting kapa"),
    ("gen-length-not-a-multiple", "eval --gen-length 60 --block-length 16",
     r"^--gen-length 60 is not a multiple of --block-length 16 \(the canvas is cut into whole blocks\)$"),
    ("steps-not-a-multiple", "eval --steps 3", r"steps=3 is not a positive multiple of the number of blocks"),
    ("tau-above-kappa", "eval --tau 0.95", r"tau=0.95 > kappa=0.9"),
    # prompts and the model's length (item 4)
    ("gen-length-beyond-the-model", "eval --gen-length 512",
     r"^--gen-length 512 leaves no room for a prompt: the model's max_sequence_length is 512$"),
    ("prompts-too-long", "eval --num-fewshot 40 --limit 3 --strategies threshold",
     r"^3 of 3 prompts are longer than the 432 tokens the model leaves for a prompt \(max_sequence_length 512 - "
     r"gen_length 80\), by up to \d+ tokens; pass --truncate-fewshot"),  # the default model: tiny-chain, gen 80
    # the lm-eval command line
    ("adapter-misspelled-key", f"{ADAPTER},kapa=0.9 --tasks gsm8k",
     r"^unknown model_args key 'kapa' \(did you mean 'kappa'\?\); the keys are "),
    ("adapter-mistyped-values", f"{ADAPTER},gen_length=abc,dtype=int8,chat=maybe,seed=-1 --tasks gsm8k",
     r"^model_args gen_length: expected an integer, got 'abc'; model_args dtype: .*; model_args chat: expected "
     r"true or false, got 'maybe'; model_args seed: expected an integer in \[0, 4294967295\], got -1"),
    ("adapter-batch-size", f"{ADAPTER} --batch_size -1 --tasks gsm8k", r"model_args batch_size: expected an integer >= 1"),
    ("adapter-model-from-command-line", "adapter --model localleap --model_args model=x,on_batch=y --tasks gsm8k",
     r"model_args model, on_batch cannot be given on the command line"),
    ("adapter-kappa-out-of-range", f"{ADAPTER},kappa=2 --tasks gsm8k", r"^model_args: localleap: kappa=2.0 must lie in \(0, 1\]"),
    ("adapter-stats-path-unwritable", f"{ADAPTER},stats_path=/sys/localleap/stats.jsonl --tasks gsm8k_mini "
                                      "--include_path {tmp}/tasks", r"^model_args stats_path: cannot write /sys/"),
    ("adapter-checkpoint-missing", "adapter --model localleap --model_args checkpoint={tmp}/nope --tasks gsm8k_mini "
                                   "--include_path {tmp}/tasks", r"no checkpoint at \S*/nope"),
    ("adapter-gen-length-beyond-the-model", f"{ADAPTER},gen_length=512,block_length=16 --tasks gsm8k_mini "
                                            "--include_path {tmp}/tasks",
     r"^gen_length=512 leaves no room for a prompt: the model's max_sequence_length is 512$"),
    # a hub task offline (the suite runs with HF_DATASETS_OFFLINE=1): one line naming the local-task route
    ("adapter-hub-task-offline", f"{ADAPTER},gen_length=64,block_length=16 --tasks gsm8k --limit 2",
     r"^lm-eval could not download the data of --tasks gsm8k \(ConnectionError: .*\): offline or the hub is "
     r"unreachable\. GSM8K from local files works offline: python -m localleap_jax\.lm_eval\.local_task OUT"),
    # issue #47: batching that would leave slots idle, a misspelled rule, the dtypes XLA's CPU backend cannot run,
    # and an output another run holds, in every command that writes one (eval_gsm8k's row is above)
    ("queue-below-slots", "eval --slots 8 --queue 3",
     r"^argument --queue: --queue 3 is below --slots 8: every compiled call would hold 8 rows for 3 prompts, 5 of "
     r"them idle; give --queue >= 8"),
    ("slots-and-batch-size-disagree", "eval --slots 8 --batch-size 4",
     r"^argument --slots: --slots 8 and --batch-size 4 both say how many rows the loop holds; give one of them$"),
    ("strategy-misspelled", "eval --strategies localleapp",
     r"^--strategies localleapp: unknown strategy 'localleapp'; did you mean 'localleap' or 'localleap_uniform'\?; a "
     r"rule of your own: --rules path/to/myrules.py$"),
    ("adapter-queue-below-slots", f"{ADAPTER},slots=8,queue=3 --tasks gsm8k",
     r"^model_args queue 3 is below model_args slots 8: every compiled call would hold 8 rows for 3 prompts"),
    ("adapter-dtype-float16", f"{ADAPTER},dtype=float16 --tasks gsm8k",
     r"^model_args dtype: expected auto, bfloat16 or float32, got 'float16'$"),
    ("likelihood-dtype-float16", "likelihood --dtype float16", r"^argument --dtype: invalid choice: 'float16'"),
    ("likelihood-dtype-float64", "likelihood --dtype float64", r"^argument --dtype: invalid choice: 'float64'"),
    ("dynamics-dtype-float16", "dynamics --dtype float16", r"^argument --dtype: invalid choice: 'float16'"),
    ("likelihood-output-held-by-another-run", "likelihood --output {tmp}/held",
     r"^--output \S*/held is in use by another run \(pid \d+ on .+\); wait for it"),
    ("dynamics-output-held-by-another-run", "dynamics --checkpoint embedded --output {tmp}/held",
     r"^--output \S*/held is in use by another run \(pid \d+ on .+\); wait for it"),
    # a likelihood setting the authors' estimator cannot draw: refused before lm-eval indexes a task
    ("adapter-mc-num-not-whole-mini-batches", f"{ADAPTER},mc_num=100,stats_path={{out}}/stats.jsonl --tasks mc_local "
                                              "--include_path {tmp}/tasks",
     r"^model_args: mc_num=100 must be a multiple of mc_batch_size=32"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """{tmp}: the files the rows point at, and a directory another run holds."""
    from localleap_jax.gsm8k import OutputDir, local_task

    tmp = tmp_path_factory.mktemp("inputs")
    (tmp / "good.jsonl").write_text("".join(
        json.dumps({"question": f"Mia has {n} apples and buys 2 more. How many apples does she have?",
                    "answer": f"{n} + 2 = <<{n}+2={n + 2}>>{n + 2}\n#### {n + 2}"}) + "\n" for n in (3, 5, 7)))
    (tmp / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    (tmp / "notjson.jsonl").write_text("{oops\n")
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "garbled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [  # each a gold the scorer cannot read
        {"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "one"}, {"question": "q", "answer": None},
        {"question": "q", "answer": "#### seven"}]))
    (tmp / "notanumber.jsonl").write_text(json.dumps({"question": "q", "answer": "#### seven"}) + "\n")
    (tmp / "afile").write_text("not a directory\n")
    tasks = tmp / "tasks"
    tasks.mkdir()
    gsm8k_mini, _ = local_task(tmp / "mini", tmp / "good.jsonl", tmp / "good.jsonl")
    (tasks / "gsm8k_mini.yaml").write_text((tmp / "mini" / "tasks" / f"{gsm8k_mini}.yaml").read_text()
                                           .replace("task: gsm8k_local", "task: gsm8k_mini"))
    (tmp / "mc.jsonl").write_text(json.dumps({"q": "1 + 1 =", "choices": ["2", "3"], "label": 0}) + "\n")
    (tasks / "mc_local.yaml").write_text(
        "task: mc_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(tmp / 'mc.jsonl'))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    held = OutputDir(tmp / "held")
    assert held.claim() is None  # held by this test process until the module ends
    (tmp / "held" / "summary.json").write_text("{}\n")
    yield tmp
    held.release()


def snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


# These rows run as the real program in a process of their own: an argument error and a model_args error
# (one per program, through `python ...`), and the one whose holder of --output must be another process.
REAL_PROCESS = {"batch-size-negative", "output-held-by-another-run", "adapter-mistyped-values"}
assert REAL_PROCESS <= {r[0] for r in ROWS}


def command(row_command: str, tmp, out) -> tuple[str, list[str]]:
    """(program alias, its arguments)."""
    words = shlex.split(row_command.format(tmp=tmp, out=out))
    argv = words[1:]
    if words[0] in WITH_OUTPUT and "--output" not in words:
        argv += ["--output", str(out)]
    return words[0], argv


@pytest.mark.parametrize("name, row_command, error", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_ends_in_one_line_and_leaves_nothing(inputs, tmp_path, capfd, compile_cache_dir, name, row_command,
                                                       error):
    out = tmp_path / "out"
    before = snapshot(inputs)
    program, argv = command(row_command, inputs, out)
    python_args, entry = PROGRAMS[program]
    if name in REAL_PROCESS:
        r = _run(*python_args, *argv, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    else:
        r = in_process(entry(), argv, capfd, compile_cache_dir)
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 2, r.stderr[-3000:]
    # One line starts with "error:", the last; lines before it (only when lm-eval had started: its logging
    # and progress bars) report no other failure.
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == lines[-1:], r.stderr[-3000:]
    assert not [line for line in lines[:-1] if re.search(r"Error|Exception", line)], r.stderr[-3000:]
    assert re.search(error, lines[-1][len("error: "):]), lines[-1]
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    assert snapshot(inputs) == before
    assert not os.path.exists("/sys/localleap-eval-out")


@pytest.mark.parametrize("program, argv, error", [
    ("adapter", ["--model", "localleap", "--model_args", "checkpoint=embedded", "--tasks", "nosuchtask", "--limit", "1"],
     r"^lm-eval knows no task nosuchtask: `python -m localleap_jax.lm_eval ls tasks` lists them, and --include_path "
     r"DIR adds tasks of your own \(YAML files\)$"),
    ("likelihood", ["--tasks", "gsm8k_minii,nosuchtask"],
     r"^--tasks: lm-eval knows no task gsm8k_minii \(did you mean gsm8k_mini\?\); nosuchtask; `python -m "
     r"localleap_jax.lm_eval ls tasks` lists them, and --tasks local runs offline$"),
])
def test_an_unknown_task_is_one_line_and_leaves_nothing(inputs, tmp_path, capfd, compile_cache_dir, monkeypatch, program,
                                                        argv, error):
    """Issue #47: `--tasks nosuchtask` ended the lm-eval command line in a 26-line traceback, and eval_likelihood left
    its response cache behind. lm-eval's own lookup runs, on an index of {tmp}/tasks alone (its index of every task it
    ships takes tens of seconds)."""
    from lm_eval.tasks import TaskManager

    index = TaskManager.__init__
    monkeypatch.setattr(TaskManager, "__init__", lambda self, *a, **k: index(
        self, include_path=str(inputs / "tasks"), include_defaults=False))
    out = tmp_path / "out"
    before = snapshot(inputs)
    r = in_process(PROGRAMS[program][1](), [*argv, *(["--output", out] if program in WITH_OUTPUT else [])], capfd,
                   compile_cache_dir)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith("error: ") and re.search(error, lines[-1][len("error: "):]), lines[-1]
    assert [line for line in lines if line.startswith("error:")] == lines[-1:]
    assert not out.exists() and snapshot(inputs) == before


# ---------------------------------------------------------------- an output that cannot be written (issue #40)

# Every command's output and cache paths, each pointed under a regular file ({blocked} = {tmp}/afile/out), which
# nobody can write under, root included (a directory made read-only with chmod does not stop root): (name, the
# real program's arguments to python, the error line after "error: ").
BLOCKED = r"\S*/afile/out\S*: \S*/afile is a file, not a directory$"
ADAPTER_ARGS = ["-m", "localleap_jax.lm_eval", "--model", "localleap", "--tasks", "gsm8k", "--limit", "1"]
UNWRITABLE = [
    ("eval_gsm8k", ["experiments/eval_gsm8k.py", "--checkpoint", "embedded", "--output", "{blocked}"],
     rf"^--output {BLOCKED}"),
    ("sweep", ["experiments/sweep.py", "--checkpoint", "embedded", "--output", "{blocked}"], rf"^--output {BLOCKED}"),
    ("analyze_dynamics", ["experiments/analyze_dynamics.py", "--checkpoint", "embedded", "--output", "{blocked}"],
     rf"^--output {BLOCKED}"),
    ("analyze_dynamics-from-traces", ["experiments/analyze_dynamics.py", "--from-traces", "{tmp}/nothing.npz",
                                      "--output", "{blocked}"], rf"^--output {BLOCKED}"),
    ("eval_likelihood", ["experiments/eval_likelihood.py", "--output", "{blocked}"], rf"^--output {BLOCKED}"),
    ("train_tiny-out", ["experiments/train_tiny.py", "--out", "{blocked}", "--steps", "2", "--warmup", "1"],
     rf"^--out {BLOCKED}"),
    ("train_tiny-export", ["experiments/train_tiny.py", "--out", "{tmp}/run", "--export", "{blocked}", "--steps", "2",
                           "--warmup", "1"], rf"^--export {BLOCKED}"),
    ("convert", ["-m", "convert", "{src}", "{blocked}", "--quiet"], rf"^output {BLOCKED}"),
    ("adapter-output_path", [*ADAPTER_ARGS, "--model_args", "checkpoint=embedded", "--output_path", "{blocked}"],
     rf"^--output_path {BLOCKED}"),
    ("adapter-output_path-json", [*ADAPTER_ARGS, "--model_args", "checkpoint=embedded", "--output_path",
                                  "{blocked}/results.json"], rf"^--output_path {BLOCKED}"),
    ("adapter-use_cache", [*ADAPTER_ARGS, "--model_args", "checkpoint=embedded", "--use_cache", "{blocked}"],
     rf"^--use_cache {BLOCKED}"),
    ("adapter-stats_path", [*ADAPTER_ARGS, "--model_args", "checkpoint=embedded,stats_path={blocked}/stats.jsonl"],
     r"^model_args stats_path: cannot write \S*/afile/out/stats.jsonl \(Not a directory\)$"),
]


@pytest.mark.parametrize("name, args, error", UNWRITABLE, ids=[u[0] for u in UNWRITABLE])
def test_an_output_that_cannot_be_written_ends_in_one_line_before_any_work(tmp_path, hf_checkpoint, name, args,
                                                                           error):
    (tmp_path / "afile").write_text("not a directory\n")
    before = snapshot(tmp_path)
    argv = [a.format(tmp=tmp_path, blocked=tmp_path / "afile" / "out", src=hf_checkpoint[0]) for a in args]
    r = _run(*argv, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert re.search(error, lines[0][len("error: "):]), lines[0]
    assert snapshot(tmp_path) == before  # nothing written, nothing left half-made


# ---------------------------------------------------------------- the model a command runs when none is named (#40)

# The embedded chain model (tiny-chain), on which the rules score apart, not tiny-math: its manifest's canvas is
# gen 80, which blocks of 32 do not cut, so each command names it in one line before loading anything (tiny-math's
# gen 64 would pass). (program arguments, the error line after "error: ")
DEFAULT_MODEL = [
    (["experiments/eval_gsm8k.py"], r"^--gen-length 80 is not a multiple of --block-length 32 "),
    (["experiments/sweep.py"], r"^gen_length=80 is not a multiple of block_length=32$"),
    (["experiments/analyze_dynamics.py"], r"^--strategy low_confidence: gen_length=80 is not a multiple of "
                                          r"block_length=32$"),
]


@pytest.mark.parametrize("program, error", DEFAULT_MODEL, ids=[p[0][0].split("/")[-1] for p in DEFAULT_MODEL])
def test_a_command_given_no_model_runs_the_chain_model(tmp_path, program, error):
    r = _run(*program, "--block-length", "32", "--output", tmp_path / "out")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert re.search(error, lines[0][len("error: "):]), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_the_adapter_given_no_checkpoint_loads_the_chain_model():
    from localleap_jax.checkpoint import EMBEDDED_CHAIN
    from localleap_jax.resolve import resolve_checkpoint
    from localleap_jax.lm_eval import parse_model_args

    settings, _ = parse_model_args({})
    assert settings["checkpoint"] == "embedded-chain" and resolve_checkpoint(settings["checkpoint"]) == EMBEDDED_CHAIN
    assert resolve_checkpoint("embedded").name == "tiny-math"  # still reachable by name
