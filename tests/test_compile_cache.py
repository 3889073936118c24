"""The persistent compilation cache: on by default in the adapter, so a second process compiles nothing new."""

import os
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPT = r"""
from lm_eval.api.instance import Instance
from localleap_jax.lm_eval import LocalLeapLM
lm = LocalLeapLM(checkpoint="embedded", dtype="float32", progress=False, strategy="threshold", gen_length=64,
                 block_length=16)
print(lm.generate_until([Instance("generate_until", {}, ("Question: Mia has 3 pens. How many pens does Mia have?"
                                                         "\nAnswer:", {"until": []}), 0)]))
"""


def test_second_process_finds_every_program_in_the_cache(tmp_path):
    env = {**os.environ, "LOCALLEAP_COMPILE_CACHE": str(tmp_path / "xla")}
    run = lambda: subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True,  # noqa: E731
                                 text=True, timeout=300)
    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    listing = lambda: sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "xla").iterdir())  # noqa: E731
    entries = listing()
    assert any(name.startswith("jit_decode_loop") for name, _ in entries)
    second = run()
    assert second.returncode == 0 and second.stdout == first.stdout
    assert listing() == entries  # every program was a cache hit: nothing compiled or rewritten


OFF_SCRIPT = r"""
import jax
from localleap_jax.compile_cache import DEFAULT_DIR, enable_compilation_cache
print(DEFAULT_DIR, enable_compilation_cache(), jax.config.jax_compilation_cache_dir)
"""


@pytest.mark.parametrize("setting", ["off", "dir"])
def test_off_turns_nothing_on_and_a_directory_is_taken(tmp_path, setting):
    """LOCALLEAP_COMPILE_CACHE=off: the commands' `enable_compilation_cache()` turns nothing on; a directory is
    the cache's."""
    value = "off" if setting == "off" else str(tmp_path / "c")
    r = subprocess.run([sys.executable, "-c", OFF_SCRIPT], cwd=REPO, env={**os.environ, "LOCALLEAP_COMPILE_CACHE": value},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == (["None"] * 3 if setting == "off" else [value] * 3)
