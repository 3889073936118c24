"""experiments/eval_likelihood.py through its command line: mistakes in one line before anything is loaded, and the
default output of each checkpoint. (The offline choice task end to end, interrupted and resumed:
tests/test_interrupts.py.)"""

from __future__ import annotations


import pytest

from localleap_jax.commands import eval_likelihood


# The local choice task end to end (summary, table, a rerun from the cache, an interrupted run's resume):
# tests/test_interrupts.py::test_ctrl_c_keeps_every_scored_likelihood_request_and_the_rerun_scores_only_the_rest.


@pytest.mark.parametrize("argv, message", [
    (["--cfg", "-1"], r"--cfg -1.0: expected a finite number >= 0"),
    (["--tasks", "local:0:0.5:16:9"], r"expected NAME\[:SHOTS\[:CFG\[:MC_NUM\]\]\]"),
    (["--mc-num", "16", "--mc-batch-size", "7"], r"--mc-num 16 is not a multiple of --mc-batch-size 7"),
    (["--checkpoint", "embedded-sdar"], r"is a block-diffusion model .* no likelihood estimator"),
])
def test_mistakes_end_in_one_line(tmp_path, capsys, argv, message):
    import re

    assert eval_likelihood.main([*argv, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_two_checkpoints_of_one_name_get_default_outputs_of_their_own(tmp_path, capfd, monkeypatch):
    """Issue #22: results/likelihood-<basename> was shared by two checkpoints of one name."""
    import shutil

    from localleap_jax.checkpoint import EMBEDDED
    from test_eval_gsm8k import _default_outputs, _other_model

    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    shutil.copytree(EMBEDDED, a)
    _other_model(b)
    named = _default_outputs(eval_likelihood.main, tmp_path, [a, b], capfd, monkeypatch, "results")
    assert named[0] != named[1] and all("/likelihood-model-" in n for n in named), named
