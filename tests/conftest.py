"""Session fixtures: the tiny checkpoints (built with tests/helpers.py) that many test files share, and the
test-wide settings (offline, hypothesis derandomised)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# JAX's persistent compilation cache stays off here (the adapter and analyze_dynamics turn it on by default): a
# worker of this suite twice died of a segfault inside XLA's deserialize_executable while reading the shared
# ~/.cache entry of a likelihood program (once in CI, once locally under load), and after a crashed worker
# pytest-xdist's loadfile scheduling waits forever. The tests of the cache give it a directory of their own.
os.environ.setdefault("LOCALLEAP_COMPILE_CACHE", "off")

import signal  # noqa: E402

# Ctrl-C as at a terminal, even when the suite was started in the background (`cmd &` in a script starts it with
# SIGINT ignored, which Python keeps and every subprocess inherits): the interrupt tests send it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# The suite compiles some two hundred small programs and runs each for milliseconds: XLA's CPU backend without
# its expensive LLVM passes compiles them about a quarter faster (the whole suite: ~15%). It changes speed and,
# at most, float rounding; every tolerance and token equality here holds under both (checked on
# test_decode_vs_torch, test_model, test_dream, test_sdar, test_rules). Subprocesses inherit it (test_dist adds it
# to its own XLA_FLAGS); benchmarks and users never see it. A caller's XLA_FLAGS win.
TEST_XLA_FLAGS = "--xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
# With libtpu installed (the [tpu-aot] extra, for the tests that compile for a TPU topology) JAX would look for TPU
# chips at start-up, fail with a page of libtpu errors and fall back to the CPU: the suite runs on the CPU, say so.
import importlib.util  # noqa: E402

if importlib.util.find_spec("libtpu") is not None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest
from hypothesis import settings

from helpers import (TOKENIZER_CORPUS, random_dream_tensors, random_llada_tensors, random_sdar_tensors,
                     tiny_dream_config, tiny_hf_config, tiny_sdar_config, write_dream_checkpoint, write_hf_checkpoint)

# The same examples on every run and machine, and no local example database: a property must hold on
# what CI draws, not on what an earlier local run happened to remember (fixed boundary cases are @examples).
settings.register_profile("repo", database=None, derandomize=True, deadline=None, max_examples=100)
settings.load_profile("repo")

# The longest files first: the test command hands whole files to two workers in collection order (`--dist
# loadfile`), so a long file collected last (alphabetical order puts test_train_tiny there) leaves one worker
# running it alone at the end. Longest first keeps the two workers' ends close. Order within a file is unchanged.
LONGEST_FIRST = ("test_dist.py", "test_eval_gsm8k.py", "test_diffusion_gemma.py", "test_eval_diffusion_gemma.py",
                 "test_lm_eval.py", "test_train_tiny.py", "test_eval_likelihood.py", "test_moe_families.py",
                 "test_dist_multihost.py", "test_cli_errors.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their own order


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from localleap_jax.families import make_tokenizer

    return make_tokenizer("llada", TOKENIZER_CORPUS, vocab_size=300)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, tiny_tokenizer):
    """(directory, hf_config, tensors): a 3-layer fp32 LLaDA-layout checkpoint in 2 shards."""
    tok = tiny_tokenizer
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id)
    tensors = random_llada_tensors(cfg, seed=0)
    path = write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-llada", cfg, tensors, tok)
    return path, cfg, tensors


@pytest.fixture(scope="session")
def converted(tmp_path_factory, hf_checkpoint):
    """The fp32 tiny checkpoint converted by localleap_jax.convert_hf."""
    from localleap_jax.convert_hf import convert

    out = tmp_path_factory.mktemp("conv") / "tiny"
    convert(str(hf_checkpoint[0]), str(out), progress=False)
    return out


@pytest.fixture(scope="session")
def sharp_checkpoint(tmp_path_factory, tiny_tokenizer):
    """(converted dir, hf_config, tensors): a 2-layer random model whose output head is scaled x20 so that
    its confidences spread over (0, 1), as decoding tests need."""
    from localleap_jax.convert_hf import convert

    tok = tiny_tokenizer
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id, n_layers=2)
    tensors = random_llada_tensors(cfg, seed=11, head_scale=20.0)
    d = tmp_path_factory.mktemp("sharp")
    convert(str(write_hf_checkpoint(d / "hf", cfg, tensors, tok)), str(d / "ck"), progress=False)
    return d / "ck", cfg, tensors


@pytest.fixture(scope="session")
def converted_sharp(sharp_checkpoint):
    return sharp_checkpoint[0]


@pytest.fixture(scope="session")
def dream_tokenizer():
    from localleap_jax.families import make_tokenizer

    return make_tokenizer("dream", TOKENIZER_CORPUS, vocab_size=300)


@pytest.fixture(scope="session")
def dream_hf_checkpoint(tmp_path_factory, dream_tokenizer):
    """(directory, hf_config, tensors): a 3-layer fp32 Dream-layout checkpoint in 2 shards, 320 embedding rows."""
    tok = dream_tokenizer
    cfg = tiny_dream_config(320, tok.mask_token_id, tok.eos_token_id)
    tensors = random_dream_tensors(cfg, seed=0)
    path = write_dream_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-dream", cfg, tensors, tok)
    return path, cfg, tensors


@pytest.fixture(scope="session")
def dream_converted(tmp_path_factory, dream_hf_checkpoint):
    """The fp32 tiny Dream checkpoint converted by localleap_jax.convert_hf."""
    from localleap_jax.convert_hf import convert

    out = tmp_path_factory.mktemp("conv") / "tiny-dream"
    convert(str(dream_hf_checkpoint[0]), str(out), progress=False)
    return out


@pytest.fixture(scope="session")
def sdar_converted(tmp_path_factory):
    """A 3-layer fp32 SDAR-layout checkpoint (block 4, GQA, head_dim 24, sharp head) converted by localleap_jax.convert_hf."""
    from localleap_jax.convert_hf import convert
    from localleap_jax.families import make_tokenizer

    tok = make_tokenizer("sdar", TOKENIZER_CORPUS, vocab_size=300)
    cfg = tiny_sdar_config(320, tok.eos_token_id)
    src = write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-sdar", cfg,
                              random_sdar_tensors(cfg, seed=1, head_scale=12.0), tok)
    out = tmp_path_factory.mktemp("conv") / "tiny-sdar"
    convert(str(src), str(out), progress=False)
    return out


# ---------------------------------------------------------------- lm-eval's environment report, once a session
# (added for the suite's running time: tests/test_eval_gsm8k.py, test_sweep.py and test_lm_eval.py use it)


@pytest.fixture(scope="session")
def lm_eval_env_report_once():
    """Every `lm_eval.simple_evaluate` adds torch's environment report to its results (torch.utils.collect_env
    runs pip, lscpu and others in subprocesses: about 0.3 s a call, and the end-to-end tests make dozens of
    calls). The environment does not change within a session, so the first call's report is handed to the
    later ones. Nothing in the tests reads the report."""
    import functools

    import torch.utils.collect_env as collect_env

    patch = pytest.MonkeyPatch()
    patch.setattr(collect_env, "get_pretty_env_info", functools.cache(collect_env.get_pretty_env_info))
    yield
    patch.undo()


_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@pytest.fixture(autouse=True)
def signal_handlers_put_back():
    """A test (or the library code it runs in process) must leave Ctrl-C, SIGTERM and SIGHUP as it found them: a
    handler left behind changes what every later test in the same worker sees, and what its subprocesses inherit
    (SIG_IGN). The handlers are put back and the test that changed them errs, naming the signal."""
    import signal

    before = {name: signal.getsignal(getattr(signal, name)) for name in _SIGNALS}
    yield
    changed = {name: signal.getsignal(getattr(signal, name)) for name in _SIGNALS
               if signal.getsignal(getattr(signal, name)) is not before[name]}
    for name in changed:
        signal.signal(getattr(signal, name), before[name])
    assert not changed, f"the test left signal handlers changed: {changed}"


@pytest.fixture(autouse=True, scope="module")
def compiled_programs_freed_after_each_file():
    """Each test file's compiled programs are freed when it ends. XLA's CPU executables each hold a few hundred
    memory mappings (JIT'ed code), and a worker that kept every program of the files it ran passed the kernel's
    vm.max_map_count (65530): a later compile or deserialisation then died of a segfault or an abort (three runs
    on 2 cores crashed so, each late in the run, in a different test)."""
    yield
    import gc

    import jax

    from localleap_jax.compile_cache import forget_compiled

    forget_compiled()
    jax.clear_caches()
    gc.collect()
