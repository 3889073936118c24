"""Every bad input through the real command line: exit status 2, one stderr line `error: ...` naming the
flag, file or field, no traceback, and nothing created or changed on disk.

A failure before lm-eval starts prints that line alone; once lm-eval runs, its logging and progress bars
come before it. One row per case: (name, command, error). `command` starts with a program alias from PROGRAMS and may use
{tmp} (a directory of prepared inputs, see `inputs`) and {out} (a path no row creates). eval_gsm8k rows get
`--output {out}` unless they name their own --output. `error` is a regular expression searched in the line
after "error: ". After every row, {out} does not exist and nothing under {tmp} changed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO

PROGRAMS = {
    "eval": [sys.executable, "experiments/eval_gsm8k.py"],
    "adapter": [sys.executable, "-m", "localleap_jax.lm_eval_adapter"],
}
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
    ("cache-unknown", "eval --cache none,fast", r"^argument --cache: unknown cache fast"),
    ("strategy-twice", "eval --strategies threshold,threshold", r"^argument --strategies: threshold given twice"),
    ("strategies-empty", "eval --strategies ,", r"^argument --strategies: no names given"),
    ("flag-misspelled", "eval --kapa 0.9", r"unrecognized arguments: --kapa"),
    ("fewshot-data-without-data", "eval --fewshot-data {tmp}/good.jsonl", r"^argument --fewshot-data: needs --data"),
    # the output directory (items 8, 9)
    ("output-is-a-file", "eval --output {tmp}/afile", r"^--output \S*/afile is a file, not a directory$"),
    ("output-under-a-file", "eval --output {tmp}/afile/sub", r"^--output \S*/afile/sub: \S*/afile is a file"),
    ("output-read-only", "eval --output /sys/localleap-eval-out", r"^--output /sys/localleap-eval-out: cannot write there"),
    ("output-held-by-another-run", "eval --output {tmp}/held",
     r"^--output \S*/held is in use by another eval \(pid \d+ on .+\); wait for it"),
    # data files (item 9: checked before the output directory exists)
    ("data-missing", "eval --data {tmp}/missing.jsonl", r"^--data \S*/missing.jsonl: no such file$"),
    ("data-is-a-directory", "eval --data {tmp}", r"^--data \S+: is a directory, not a file$"),
    ("data-row-without-keys", "eval --data {tmp}/bad.jsonl", r"^--data \S*/bad.jsonl:2 needs the keys 'question' and 'answer'"),
    ("data-not-json", "eval --data {tmp}/notjson.jsonl", r"^--data \S*/notjson.jsonl:1 is not valid JSON"),
    ("data-empty", "eval --data {tmp}/empty.jsonl", r"^--data \S*/empty.jsonl holds no problems$"),
    ("fewshot-data-bad", "eval --data {tmp}/good.jsonl --fewshot-data {tmp}/bad.jsonl",
     r"^--fewshot-data \S*/bad.jsonl:2 needs the keys"),
    ("fewshot-examples-too-few", "eval --data {tmp}/good.jsonl --num-fewshot 3",
     r"^--num-fewshot 3: \S*/good.jsonl offers only 2 few-shot examples per problem$"),
    # the checkpoint and the decoding settings
    ("checkpoint-missing", "eval --checkpoint {tmp}/nope", r"no checkpoint at \S*/nope"),
    ("strategy-unknown", "eval --strategies low_confidence,greedy", r"^--strategies: unknown strategy greedy"),
    ("gen-length-not-a-multiple", "eval --gen-length 60", r"gen_length=60 is not a multiple of block_length=16"),
    ("steps-not-a-multiple", "eval --steps 3", r"steps=3 is not a positive multiple of the number of blocks"),
    ("tau-above-kappa", "eval --tau 0.95", r"tau=0.95 > kappa=0.9"),
    # prompts and the model's length (item 4)
    ("gen-length-beyond-the-model", "eval --gen-length 512",
     r"^--gen-length 512 leaves no room for a prompt: the model's max_sequence_length is 512$"),
    ("prompts-too-long", "eval --num-fewshot 40 --limit 3 --strategies threshold",
     r"^3 of 3 prompts are longer than the 448 tokens the model leaves for a prompt \(max_sequence_length 512 - "
     r"gen_length 64\), by up to \d+ tokens; pass --truncate-fewshot"),
    # the lm-eval command line
    ("adapter-misspelled-key", f"{ADAPTER},kapa=0.9 --tasks gsm8k",
     r"^unknown model_args key 'kapa' \(did you mean 'kappa'\?\); the keys are "),
    ("adapter-mistyped-values", f"{ADAPTER},gen_length=abc,dtype=int8,chat=maybe,seed=-1 --tasks gsm8k",
     r"^model_args gen_length: expected an integer, got 'abc'; model_args dtype: .*; model_args chat: expected "
     r"true or false, got 'maybe'; model_args seed: expected an integer in \[0, 4294967295\], got -1"),
    ("adapter-batch-size", f"{ADAPTER} --batch_size -1 --tasks gsm8k", r"model_args batch_size: expected an integer >= 1"),
    ("adapter-model-from-command-line", "adapter --model localleap --model_args model=x,on_batch=y --tasks gsm8k",
     r"model_args model, on_batch cannot be given on the command line"),
    ("adapter-kappa-out-of-range", f"{ADAPTER},kappa=2 --tasks gsm8k", r"^model_args: kappa=2.0 must lie in \(0, 1\]"),
    ("adapter-stats-path-unwritable", f"{ADAPTER},stats_path=/sys/localleap/stats.jsonl --tasks gsm8k_mini "
                                      "--include_path {tmp}/tasks", r"^model_args stats_path: cannot write /sys/"),
    ("adapter-checkpoint-missing", "adapter --model localleap --model_args checkpoint={tmp}/nope --tasks gsm8k_mini "
                                   "--include_path {tmp}/tasks", r"no checkpoint at \S*/nope"),
    ("adapter-gen-length-beyond-the-model", f"{ADAPTER},gen_length=512,block_length=16 --tasks gsm8k_mini "
                                            "--include_path {tmp}/tasks",
     r"^gen_length=512 leaves no room for a prompt: the model's max_sequence_length is 512$"),
    # a generation task and a log-likelihood task: refused before any generation (no stats are written)
    ("adapter-mixed-tasks", f"{ADAPTER},stats_path={{out}}/stats.jsonl --tasks gsm8k_mini,mc_local "
                            "--include_path {tmp}/tasks",
     r"^localleap generates only: task\(s\) mc_local ask for log-likelihoods"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """{tmp}: the files the rows point at, and a directory another run holds."""
    import eval_gsm8k

    tmp = tmp_path_factory.mktemp("inputs")
    (tmp / "good.jsonl").write_text("".join(
        json.dumps({"question": f"Mia has {n} apples and buys 2 more. How many apples does she have?",
                    "answer": f"{n} + 2 = <<{n}+2={n + 2}>>{n + 2}\n#### {n + 2}"}) + "\n" for n in (3, 5, 7)))
    (tmp / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    (tmp / "notjson.jsonl").write_text("{oops\n")
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "afile").write_text("not a directory\n")
    tasks = tmp / "tasks"
    tasks.mkdir()
    gsm8k_mini, _ = eval_gsm8k.local_task(tmp / "mini", tmp / "good.jsonl", tmp / "good.jsonl")
    (tasks / "gsm8k_mini.yaml").write_text((tmp / "mini" / "tasks" / f"{gsm8k_mini}.yaml").read_text()
                                           .replace("task: gsm8k_local", "task: gsm8k_mini"))
    (tmp / "mc.jsonl").write_text(json.dumps({"q": "1 + 1 =", "choices": ["2", "3"], "label": 0}) + "\n")
    (tasks / "mc_local.yaml").write_text(
        "task: mc_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(tmp / 'mc.jsonl'))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    held = eval_gsm8k.OutputDir(tmp / "held")
    assert held.claim() is None  # held by this test process until the module ends
    (tmp / "held" / "summary.json").write_text("{}\n")
    yield tmp
    held.release()


def snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def command(row_command: str, tmp, out) -> list[str]:
    words = shlex.split(row_command.format(tmp=tmp, out=out))
    argv = PROGRAMS[words[0]] + words[1:]
    if words[0] == "eval" and "--output" not in words:
        argv += ["--output", str(out)]
    return argv


@pytest.mark.parametrize("name, row_command, error", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_ends_in_one_line_and_leaves_nothing(inputs, tmp_path, name, row_command, error):
    out = tmp_path / "out"
    before = snapshot(inputs)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run(command(row_command, inputs, out), cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
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
