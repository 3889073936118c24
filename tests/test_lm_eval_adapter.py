"""The lm-eval adapter on the embedded model: lm-eval's own task, filters and cache around our generate()."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import localleap_jax as ll
from conftest import REPO
from localleap_jax.checkpoint import EMBEDDED
from localleap_jax.lm_eval_adapter import GenerationOnlyError, LocalLeapLM, cut_at_until

DECODE = dict(strategy="localleap", gen_length=64, block_length=16)


@pytest.fixture(scope="module")
def embedded():
    return ll.load(EMBEDDED, dtype="float32")


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    """The stock lm-eval gsm8k task on 20 held-out synthetic problems (JSONL on disk, no download)."""
    import eval_gsm8k
    import synthetic_math

    d = tmp_path_factory.mktemp("task")
    synthetic_math.write_jsonl(synthetic_math.take("test", 20, seed=5), str(d / "test.jsonl"))
    synthetic_math.write_jsonl(synthetic_math.take("train", 5, seed=5), str(d / "train.jsonl"))
    name, include = eval_gsm8k.local_task(d, d / "test.jsonl", d / "train.jsonl")
    return name, include


def _evaluate(lm, local_task, **kw):
    import lm_eval
    from lm_eval.tasks import TaskManager

    name, include = local_task
    return lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=TaskManager(include_path=str(include)),
                                   num_fewshot=0, log_samples=True, bootstrap_iters=0, **kw)


def test_simple_evaluate_generates_with_generate_and_scores_with_lm_eval_filters(embedded, local_task):
    lm = LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False, **DECODE)
    res = _evaluate(lm, local_task)
    name = local_task[0]
    samples = res["samples"][name]
    strict = [s for s in samples if s["filter"] == "strict-match"]
    assert len(strict) == 20
    # what lm-eval scored is exactly our generate() on the chat-formatted prompt, cut at `until`
    contexts = [s["arguments"][0][0] for s in strict]
    ids, mask = embedded.tokenizer.encode_batch(contexts)
    out = ll.generate(embedded, ids, mask, ll.DecodeConfig(**DECODE))
    direct = [cut_at_until(t, ["Question:", "</s>", "<|im_end|>"]) for t in embedded.tokenizer.decode_generated(out)]
    assert [s["resps"][0][0] for s in strict] == direct
    # lm-eval's strict-match filter took "#### N" out of each answer, and its metric averaged the matches
    for s in strict:
        m = re.search(r"#### (\-?[0-9\.\,]+)", s["resps"][0][0])  # the pattern in lm-eval's gsm8k.yaml
        assert s["filtered_resps"][0] == (m.group(1) if m else "[invalid]")
    acc = res["results"][name]["exact_match,strict-match"]
    assert acc == pytest.approx(np.mean([s["exact_match"] for s in strict]))
    # NFE and time per request were recorded
    assert all(lm.stats[k]["nfe"] > 0 for k in lm.stats) and len(lm.stats) == 20


def test_output_is_cut_at_the_requests_until_strings(embedded):
    from lm_eval.api.instance import Instance

    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, **DECODE)
    ctx = "Question: Mia has 3 apples. She gets 4 more apples. How many apples does Mia have now?\nAnswer:"
    full, cut = lm.generate_until([
        Instance("generate_until", {}, (ctx, {"until": ["Question:"]}), 0),
        Instance("generate_until", {}, (ctx, {"until": [" = ", "apples"]}), 1),
    ])
    assert " = " in full or "apples" in full
    stops = [i for i in (full.find(" = "), full.find("apples")) if i >= 0]
    assert cut == full[:min(stops)]
    assert cut_at_until("a b c", "b") == "a " and cut_at_until("abc", None) == "abc"


def test_rerun_with_the_cache_makes_no_model_call_and_an_interrupted_run_resumes(embedded, local_task, tmp_path):
    cache = str(tmp_path / "cache" / "localleap")

    class Interrupt(Exception):
        pass

    def stop_after_first_batch(requests, texts, stats):
        raise Interrupt

    first = LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False,
                        stats_path=cache + ".stats.jsonl", on_batch=stop_after_first_batch, **DECODE)
    with pytest.raises(Interrupt):
        _evaluate(first, local_task, use_cache=cache, limit=12)
    assert first.model_calls == 1

    resumed = LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False,
                          stats_path=cache + ".stats.jsonl", **DECODE)
    res = _evaluate(resumed, local_task, use_cache=cache, limit=12)
    assert resumed.model_calls == 1  # only the 4 requests the interrupted run had not finished
    again = LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False,
                        stats_path=cache + ".stats.jsonl", **DECODE)
    res2 = _evaluate(again, local_task, use_cache=cache, limit=12)
    assert again.model_calls == 0
    name = local_task[0]
    assert res2["results"][name]["exact_match,strict-match"] == res["results"][name]["exact_match,strict-match"]
    assert len(again.stats) == 12  # NFE/seconds of every request survive in the stats file


def test_loglikelihood_tasks_end_with_one_clear_line(tmp_path):
    (tmp_path / "mc.jsonl").write_text(json.dumps({"q": "1 + 1 =", "choices": ["2", "3"], "label": 0}) + "\n")
    (tmp_path / "mc_local.yaml").write_text(
        "task: mc_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(tmp_path / 'mc.jsonl'))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "localleap_jax.lm_eval_adapter", "--model", "localleap",
                        "--model_args", "checkpoint=embedded,compile_cache=False", "--tasks", "mc_local",
                        "--include_path", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: localleap generates only: task(s) mc_local ask for log-likelihoods")
    assert "Traceback" not in r.stderr


def test_unknown_model_args_are_named(embedded):
    with pytest.raises(TypeError, match=r"unknown model_args \['kapa'\]"):
        LocalLeapLM(model=embedded, compile_cache=False, kapa=0.9)
    with pytest.raises(GenerationOnlyError):
        LocalLeapLM(model=embedded, compile_cache=False).loglikelihood([])
