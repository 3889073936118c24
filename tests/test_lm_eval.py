"""The lm-eval adapter on the embedded model: lm-eval's own task, filters and cache around our generate()."""

import dataclasses
import json
import re
import types

import jax
import numpy as np
import pytest

import localleap_jax as ll
from helpers import decode_config
from localleap_jax.checkpoint import EMBEDDED
from localleap_jax.lm_eval import CacheMismatchError, LocalLeapLM, ModelArgsError, cut_at_until

pytestmark = pytest.mark.usefixtures("lm_eval_env_report_once")  # conftest: torch's environment report once

DECODE = dict(strategy="localleap", gen_length=64, block_length=16)


@pytest.fixture(scope="module")
def embedded():
    return ll.load(EMBEDDED, dtype="float32")


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    """The stock lm-eval gsm8k task on 20 held-out synthetic problems (JSONL on disk, no download)."""
    from localleap_jax import gsm8k, synthetic_math

    d = tmp_path_factory.mktemp("task")
    synthetic_math.write_jsonl(synthetic_math.take("test", 20, seed=5), str(d / "test.jsonl"))
    synthetic_math.write_jsonl(synthetic_math.take("train", 5, seed=5), str(d / "train.jsonl"))
    name, include = gsm8k.local_task(d, d / "test.jsonl", d / "train.jsonl")
    return name, include


def _evaluate(lm, local_task, **kw):
    import lm_eval
    from lm_eval.tasks import TaskManager

    name, include = local_task
    # include_defaults=False: the local task includes the stock gsm8k.yaml by path (indexing every stock task
    # would cost half a minute per call)
    return lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=TaskManager(include_path=str(include),
                                                                                    include_defaults=False),
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
    direct = [_cut(t, ["Question:", "</s>", "<|im_end|>"]) for t in embedded.tokenizer.decode_generated(out)]
    assert [s["resps"][0][0] for s in strict] == direct
    # lm-eval's strict-match filter took "#### N" out of each answer, and its metric averaged the matches
    for s in strict:
        m = re.search(r"#### (\-?[0-9\.\,]+)", s["resps"][0][0])  # the pattern in lm-eval's gsm8k.yaml
        assert s["filtered_resps"][0] == (m.group(1) if m else "[invalid]")
    acc = res["results"][name]["exact_match,strict-match"]
    assert acc == pytest.approx(np.mean([s["exact_match"] for s in strict]))
    # NFE and time per request were recorded
    assert all(lm.stats[k]["nfe"] > 0 for k in lm.stats) and len(lm.stats) == 20


def _cut(text: str, until: list[str]) -> str:
    """lm-eval's rule, stated independently: the text before the earliest occurrence of any stop string."""
    found = [text.find(stop) for stop in until if stop and stop in text]
    return text[:min(found)] if found else text


@pytest.mark.parametrize("text, until, expected", [
    ("Mia has 7 apples = 7\nQuestion: next", ["Question:", " = "], "Mia has 7 apples"),  # the second comes first
    ("a b Question: c = d", [" = ", "Question:"], "a b "),  # the first comes first
    ("x</s>y<|im_end|>z", ["<|im_end|>", "</s>"], "x"),
    ("x<|im_end|>y</s>z", ["<|im_end|>", "</s>"], "x"),
    ("Question: at the very start", ["Question:"], ""),
    ("no stop string here", ["Question:", "</s>"], "no stop string here"),
    ("a = b = c", [" = "], "a"),  # the first occurrence of a string that occurs twice
    ("abc", "b", "a"),  # one string, not a list
    ("abc", ["", "c"], "ab"),  # an empty stop string cuts nothing
    ("abc", None, "abc"),
    ("abc", [], "abc"),
])
def test_cut_at_until_cuts_at_the_earliest_stop_string(text, until, expected):
    assert cut_at_until(text, until) == expected


def test_output_is_cut_at_the_requests_until_strings(embedded):
    from lm_eval.api.instance import Instance

    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, **DECODE)
    ctx = "Question: Mia has 3 apples. She gets 4 more apples. How many apples does Mia have now?\nAnswer:"
    until = ["####", " = "]  # the answer's "#### N" comes after its "a + b = c": the second stop string cuts
    full, cut = lm.generate_until([
        Instance("generate_until", {}, (ctx, {"until": []}), 0),
        Instance("generate_until", {}, (ctx, {"until": until}), 1),
    ])
    assert 0 <= full.find(" = ") < full.find("####"), full  # the case: both occur, the second listed first
    assert cut == full[:full.find(" = ")]


def test_a_short_last_batch_runs_the_full_batches_program_and_answers_as_alone(embedded):
    from lm_eval.api.instance import Instance

    from localleap_jax.compile_cache import compiled_programs, forget_compiled

    forget_compiled()  # this test's programs compile here, counted from `seen` on
    seen = len(compiled_programs())
    ctxs = [f"Question: Mia has {a} apples. She gets {b} more apples. How many apples does Mia have now?\nAnswer:"
            for a, b in zip((3, 5, 2, 7, 4, 6), (4, 1, 6, 2, 3, 5))]  # one prompt length: one bucket
    assert len({len(embedded.tokenizer.encode(c)) for c in ctxs}) == 1
    reqs = [Instance("generate_until", {}, (c, {"until": []}), i) for i, c in enumerate(ctxs)]
    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, batch_size=4, queue=4, **DECODE)
    answers = lm.generate_until(reqs)
    assert lm.model_calls == 2  # the case: batches of 4 and 2 (queue = slots: fixed batches)
    assert len(compiled_programs()) == seen + 1  # the batch of 2 ran the batch of 4's program
    assert sorted(r["batch_size"] for r in lm.stats.values()) == [2, 2, 4, 4, 4, 4]  # filler rows are not counted
    alone = LocalLeapLM(model=embedded, compile_cache=False, progress=False, batch_size=1, **DECODE)
    assert answers == alone.generate_until(reqs)


def test_slots_take_a_queue_of_requests_in_one_call_and_answer_as_alone(embedded):
    """slots=2, queue=5: one compiled call of 5 requests through 2 rows (continuous batching); the stats rows say
    so (each request's share of the call's passes, the rows held), and the answers are each request's alone."""
    from lm_eval.api.instance import Instance

    ctxs = [f"Question: Tom has {a} pens. He loses {b} pens. How many pens does Tom have now?\nAnswer:"
            for a, b in zip((9, 8, 7, 6, 5), (1, 2, 3, 4, 5))]
    reqs = [Instance("generate_until", {}, (c, {"until": []}), i) for i, c in enumerate(ctxs)]
    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, batch_size=2, queue=5,
                     **{**DECODE, "early_stop": True})
    answers = lm.generate_until(reqs)
    assert lm.model_calls == 1 and lm.slots == 2
    rows = list(lm.stats.values())
    assert {r["slots"] for r in rows} == {2} and {r["batch_size"] for r in rows} == {5}
    passes = sum(r["passes_share"] for r in rows)
    assert sum(r["nfe"] for r in rows) <= 2 * passes  # occupancy <= 1
    assert passes < sum(r["nfe"] for r in rows)  # the two rows worked side by side
    alone = LocalLeapLM(model=embedded, compile_cache=False, progress=False, batch_size=1, queue=1,
                        **{**DECODE, "early_stop": True})
    assert answers == alone.generate_until(reqs)


def test_rerun_with_the_cache_makes_no_model_call_and_an_interrupted_run_resumes(embedded, local_task, tmp_path):
    cache = str(tmp_path / "cache" / "localleap")

    class Interrupt(Exception):
        pass

    def stop_after_first_batch(requests, texts, stats):
        raise Interrupt

    # calls of 8 requests through 4 slots: the interrupted run keeps its first call's 8 answers
    first = LocalLeapLM(model=embedded, batch_size=4, queue=8, compile_cache=False, progress=False,
                        stats_path=cache + ".stats.jsonl", on_batch=stop_after_first_batch, **DECODE)
    with pytest.raises(Interrupt):
        _evaluate(first, local_task, use_cache=cache, limit=12)
    assert first.model_calls == 1

    resumed = LocalLeapLM(model=embedded, batch_size=4, queue=8, compile_cache=False, progress=False,
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


def test_unknown_model_args_are_named(embedded):
    with pytest.raises(ModelArgsError, match=r"unknown model_args key 'kapa' \(did you mean 'kappa'\?\)"):
        LocalLeapLM(model=embedded, compile_cache=False, kapa=0.9)
    with pytest.raises(ModelArgsError, match=r"model_args cfg: expected a number >= 0"):
        LocalLeapLM(model=embedded, compile_cache=False, cfg=-1)


def test_the_shared_settings_in_model_args_map_onto_the_rule_as_the_command_lines_flags():
    """kappa=, tau=, radius=, steps= beside strategy= (lm-eval splits model_args at commas): each applies to a rule
    that has it, never over the strategy's own spec, and is ignored by a rule without it
    (rules.with_shared_settings)."""
    from localleap_jax.lm_eval.args import parse_model_args

    for given, want in [
        (dict(strategy="localleap:kappa=0.95", kappa="0.8", tau="0.7", steps="16"), ll.rule("localleap", kappa=0.95,
                                                                                          tau=0.7)),
        (dict(strategy="low_confidence", kappa=0.5, radius=1, steps=16), ll.rule("low_confidence", steps=16)),
        (dict(strategy="klass", tau_kl=0.05, steps=16), ll.rule("klass", tau_kl=0.05, steps=16)),  # its own, folded in
        (dict(kappa=0.8), ll.rule("localleap", kappa=0.8)),  # the default strategy
    ]:
        _, cfg = parse_model_args(given)
        assert type(cfg.rule) is type(want) and cfg.rule.spec() == want.spec(), given
    with pytest.raises(ModelArgsError, match=r"^model_args: shared setting: kappa=2.0 must lie in \(0, 1\]"):
        parse_model_args(dict(strategy="low_confidence", kappa=2))


# ---------------------------------------------------------------- issue #8: answers are never missing (item 1)


def _ask(*contexts, doc=None):
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", doc or {}, (c, {"until": ["Question:"]}), i) for i, c in enumerate(contexts)]


QUESTION = "Question: Mia has 3 pens. She buys 4 more pens. How many pens does Mia have now?\nAnswer:"


@pytest.mark.parametrize("batch_size", [-1, 0, "many", 2.5, True])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(embedded, batch_size):
    with pytest.raises(ModelArgsError, match=r"model_args batch_size: expected an integer"):
        LocalLeapLM(model=embedded, batch_size=batch_size, compile_cache=False, progress=False, **DECODE)


def test_generate_until_fails_rather_than_return_a_missing_answer(embedded):
    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, **DECODE)
    lm.batch_size = lm.queue = -1  # what an unchecked --batch-size -1 reached: no batch ran, every answer None
    with pytest.raises(AssertionError, match=r"left 1 of 1 requests unanswered"):
        lm.generate_until(_ask(QUESTION))


def _answer_keys(db_path) -> list[str]:
    from sqlitedict import SqliteDict

    with SqliteDict(db_path) as db:
        return [k for k, v in db.items() if isinstance(v, str)]


def test_a_response_cache_holding_missing_answers_generates_them_again(embedded, local_task, tmp_path):
    from sqlitedict import SqliteDict

    cache = str(tmp_path / "cache" / "localleap")
    first = LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False, **DECODE)
    res = _evaluate(first, local_task, use_cache=cache, limit=8)
    with SqliteDict(cache + "_rank0.db", autocommit=True) as db:
        for k in _answer_keys(cache + "_rank0.db")[:3]:
            db[k] = None  # what `--batch-size -1` left behind; every later run died on lm-eval's assert
    again = LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False, **DECODE)
    res2 = _evaluate(again, local_task, use_cache=cache, limit=8)
    assert again.rows_generated == 3
    name = local_task[0]
    answers = lambda r: [s["resps"][0][0] for s in r["samples"][name] if s["filter"] == "strict-match"]
    assert answers(res2) == answers(res) and all(isinstance(a, str) for a in answers(res2))
    assert len(_answer_keys(cache + "_rank0.db")) == 8


# ---------------------------------------------------------------- what answers depend on (item 2)


def test_a_response_cache_of_another_setup_is_refused_before_generating(embedded, local_task, tmp_path):
    from localleap_jax.lm_eval import CacheMismatchError

    cache = str(tmp_path / "cache" / "localleap")
    _evaluate(LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False, **DECODE), local_task,
              use_cache=cache, limit=4)
    other = LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False, **{**DECODE, "kappa": 0.8})
    with pytest.raises(CacheMismatchError, match=r"holds answers of another setup \(decode\.rule differ\)"):
        _evaluate(other, local_task, use_cache=cache, limit=4)
    assert other.model_calls == 0
    # a cache with answers but no record of who wrote them (an older version) is not taken on trust
    from lm_eval.api.model import CacheHook
    from sqlitedict import SqliteDict

    with SqliteDict(str(tmp_path / "old.db"), autocommit=True) as db:
        db["some request"] = "an answer from who knows which model"
        with pytest.raises(CacheMismatchError, match=r"holds answers with no record of the model and settings"):
            other.set_cache_hook(CacheHook(types.SimpleNamespace(dbdict=db)))


@pytest.fixture(scope="module")
def variants(embedded, tmp_path_factory):
    """Checkpoints that differ from the embedded one in one way each (or, `moved`, in none but the path)."""
    import shutil

    root = tmp_path_factory.mktemp("variants")
    made = {}
    for name, edit in {
        "moved": None,
        "tokenizer": ("chat_template.jinja", lambda text: text.replace("assistant", "helper")),
        "model_config": ("config.json", lambda text: text.replace('"rope_theta": 10000.0', '"rope_theta": 20000.0')),
    }.items():
        shutil.copytree(EMBEDDED, root / name)
        if edit:
            f = root / name / edit[0]
            changed = edit[1](f.read_text())
            assert changed != f.read_text()
            f.write_text(changed)
        made[name] = ll.load(root / name, dtype="float32")
    made["bfloat16"] = ll.load(EMBEDDED, dtype="bfloat16")
    return made


BATCH = {"batch_size": 8, "devices": 1}


def _key(model, *, chat=True, seed=0, truncate=False, batch=BATCH, task=None, **decode):
    from localleap_jax.lm_eval import answers_key, key_digest

    cfg = decode_config(**{**DECODE, **decode})  # kappa, tau, radius, steps: the shared flags, as model_args take them
    return key_digest(answers_key(model, cfg, chat=chat, seed=seed, truncate_fewshot=truncate, batch=batch, task=task))


CHANGES_TOKENS = [dict(kappa=0.8), dict(tau=0.7), dict(radius=2), dict(gen_length=32), dict(block_length=8),
                  dict(cache="prefix"), dict(temperature=0.5), dict(early_stop=True), dict(logits_eos_inf=True),
                  dict(confidence_eos_eot_inf=True), dict(strategy="threshold"), dict(chat=False),
                  dict(truncate="\n\n"), dict(task={"data": "abc"})]
CHANGES_NOTHING = [dict(prompt_bucket=32), dict(batch={"batch_size": 2, "devices": 4, "limit": 10}), dict(seed=7)]


@pytest.mark.parametrize("change", CHANGES_TOKENS, ids=lambda c: ",".join(c))
def test_the_resume_key_follows_every_setting_that_changes_tokens(embedded, change):
    assert _key(embedded, **change) != _key(embedded)


@pytest.mark.parametrize("change", CHANGES_NOTHING, ids=lambda c: ",".join(c))
def test_the_resume_key_ignores_settings_that_change_no_token(embedded, change):
    assert _key(embedded, **change) == _key(embedded)


def test_the_resume_key_follows_the_model_and_only_what_matters_of_the_settings(embedded, variants):
    # the weights, wherever they live
    assert _key(variants["moved"]) == _key(embedded)
    for name in ("tokenizer", "model_config", "bfloat16"):
        assert _key(variants[name]) != _key(embedded), name
    in_memory = dataclasses.replace(embedded, path=None)
    nudged = jax.tree.map(lambda a: a, embedded.params)
    nudged["ln_f"]["scale"] = nudged["ln_f"]["scale"] * 1.001
    assert _key(dataclasses.replace(in_memory, params=nudged)) != _key(in_memory)
    # a strategy's key holds the settings it reads, not the others
    assert _key(embedded, strategy="low_confidence", kappa=0.5, radius=1) == _key(embedded, strategy="low_confidence")
    assert _key(embedded, strategy="low_confidence", steps=16) != _key(embedded, strategy="low_confidence")
    assert _key(embedded, strategy="threshold", tau=0.5, radius=1) == _key(embedded, strategy="threshold")
    # rows of a batch change each other's tokens only when sampling (one key per batch); with a KV cache they
    # advance together, but a waiting row's canvas and cache do not change (tests/test_decode.py)
    other_batch = {"batch_size": 2, "devices": 1}
    assert _key(embedded, cache="prefix", batch=other_batch) == _key(embedded, cache="prefix")
    assert _key(embedded, temperature=0.5, seed=1) != _key(embedded, temperature=0.5)


# ---------------------------------------------------------------- prompts that do not fit (item 4)


def test_a_gen_length_beyond_the_model_names_the_cause(embedded):
    with pytest.raises(ModelArgsError, match=r"gen_length=512 leaves no room for a prompt: the model's "
                                             r"max_sequence_length is 512"):
        LocalLeapLM(model=embedded, compile_cache=False, progress=False, strategy="threshold", gen_length=512,
                    block_length=16)


def test_over_long_prompts_are_refused_before_anything_is_generated(embedded):
    from localleap_jax.lm_eval import PromptTooLongError

    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, **DECODE)  # room: 512 - 64 = 448
    long_ones = [f"Question: {'one two three ' * n}how many?\nAnswer:" for n in (120, 200)]
    over = [len(embedded.tokenizer.encode(c)) - 448 for c in long_ones]
    assert min(over) > 0
    with pytest.raises(PromptTooLongError) as e:
        lm.generate_until(_ask(QUESTION, *long_ones))
    assert str(e.value).startswith(f"2 of 3 prompts are longer than the 448 tokens the model leaves for a prompt "
                                   f"(max_sequence_length 512 - gen_length 64), by up to {max(over)} tokens; "
                                   "2 of them stay too long with every few-shot example dropped")
    # no few-shot text to drop, and longer than the whole window: the advice is what would help (issue #47)
    assert "truncate_fewshot" not in str(e.value) and re.search(
        r"\(up to \d+ tokens\): leave those documents out \(--limit\), or use a model with a longer window$", str(e.value))
    assert lm.model_calls == 0


@pytest.mark.parametrize("context, message", [
    (None, r"^request 1's context is None; a prompt must be a str$"),
    (b"Question: 1 + 1?", r"^request 1's context is bytes b'Question: 1 \+ 1\?'; a prompt must be a str \(decode it"),
])
def test_a_context_that_is_not_text_is_named_before_anything_is_generated(embedded, context, message):
    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, **DECODE)
    with pytest.raises(TypeError, match=message):
        lm.generate_until(_ask(QUESTION, context))
    assert lm.model_calls == 0


def _gsm8k_context(examples, question, description=""):
    """A context laid out as lm-eval's gsm8k task lays it out (doc_to_text, target delimiter " ", "\\n\\n")."""
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in examples)
    return description + shots + f"Question: {question}\nAnswer:"


EXAMPLES = [(f"Tom has {n} pens.\n\nHe buys {n + 1} more. How many pens does he have?",
             f"{n} + {n + 1} = <<{n}+{n + 1}={2 * n + 1}>>{2 * n + 1}\n#### {2 * n + 1}") for n in range(1, 31)]
FINAL = "Ava has 5 cups.\n\nShe breaks 2 of them. How many cups are left?"


def test_fewshot_spans_find_whole_examples_even_with_blank_lines_inside_them():
    from localleap_jax.lm_eval import fewshot_spans

    for description in ("", "Solve these problems.\n\n"):
        context = _gsm8k_context(EXAMPLES[:3], FINAL, description)
        starts, question = fewshot_spans(context, {"question": FINAL, "answer": "3"}, "\n\n")
        example_lengths = [len(f"Question: {q}\nAnswer: {a}\n\n") for q, a in EXAMPLES[:3]]
        expected = [len(description) + sum(example_lengths[:i]) for i in range(3)]
        assert starts == expected
        assert question == len(description) + sum(example_lengths)
        assert context[question:] == f"Question: {FINAL}\nAnswer:"
    assert fewshot_spans(f"Question: {FINAL}\nAnswer:", {"question": FINAL}, "\n\n") is None  # no examples
    assert fewshot_spans(_gsm8k_context(EXAMPLES[:3], FINAL), {}, "\n\n") is None  # the question cannot be found


def test_truncate_fewshot_drops_whole_examples_from_the_front_and_keeps_the_template(embedded):
    tok = embedded.tokenizer
    context = _gsm8k_context(EXAMPLES, FINAL)
    assert len(tok.encode(context)) > 448
    # independently: the fewest leading examples whose removal makes the chat-formatted prompt fit
    dropped = next(d for d in range(len(EXAMPLES)) if len(tok.encode(_gsm8k_context(EXAMPLES[d:], FINAL))) <= 448)
    assert 0 < dropped < len(EXAMPLES) - 1
    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, truncate_fewshot=True, **DECODE)
    (prompt,) = lm._fit_prompts(_ask(context, doc={"question": FINAL, "answer": "#### 3"}))
    assert prompt.fewshot_dropped == dropped
    assert prompt.ids == tok.encode(_gsm8k_context(EXAMPLES[dropped:], FINAL))
    text = tok.hf.decode(prompt.ids)
    assert text.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nQuestion: Tom has")
    assert text.endswith(f"Question: {FINAL}\nAnswer:<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


# ---------------------------------------------------------------- the stats log (item 7)


def test_a_torn_last_stats_record_is_dropped_and_the_log_stays_appendable(embedded, tmp_path):
    path = tmp_path / "s.stats.jsonl"
    good = [json.dumps({"key": "a", "nfe": 3}), "{not json", json.dumps({"key": "b", "nfe": 4})]
    path.write_text("\n".join(good) + "\n" + '{"key": "c", "nf')  # killed in the middle of a write
    lm = LocalLeapLM(model=embedded, stats_path=str(path), compile_cache=False, progress=False, **DECODE)
    assert set(lm.stats) == {"a", "b"}
    assert path.read_text() == "\n".join(good) + "\n"
    lm._append_stats([{"key": "d", "nfe": 1}])
    assert path.read_text().splitlines()[-1] == json.dumps({"key": "d", "nfe": 1})


def test_an_answer_is_cached_only_after_its_stats_are_written(embedded, local_task, tmp_path):
    cache = str(tmp_path / "cache" / "localleap")
    lm = LocalLeapLM(model=embedded, batch_size=8, compile_cache=False, progress=False,
                     stats_path=cache + ".stats.jsonl", **DECODE)

    def full_disk(rows):
        raise OSError(28, "No space left on device")

    lm._append_stats = full_disk
    with pytest.raises(OSError, match="No space left"):
        _evaluate(lm, local_task, use_cache=cache, limit=4)
    assert lm.model_calls == 1 and _answer_keys(cache + "_rank0.db") == []


# ---------------------------------------------------------------- lm-eval's entry point


def test_the_entry_point_names_the_package_s_class():
    import importlib
    import tomllib

    from helpers import REPO

    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["lm_eval.models"]
    module, _, name = entry["localleap"].partition(":")
    assert getattr(importlib.import_module(module), name) is LocalLeapLM
    from lm_eval.api.registry import get_model

    assert get_model("localleap") is LocalLeapLM


# ---------------------------------------------------------------- log-likelihood requests (multiple choice)


@pytest.fixture(scope="module")
def choice_task(tmp_path_factory, embedded):
    from localleap_jax.lm_eval.choice_task import write_choice_task

    return write_choice_task(tmp_path_factory.mktemp("choice"), embedded.tokenizer, n=8)


def test_a_choice_task_scores_with_ll_loglikelihood_and_resumes_from_the_cache(embedded, choice_task, local_task,
                                                                               tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    name, include = choice_task
    settings = dict(mc_num=16, mc_batch_size=8, cfg=0.5, compile_cache=False, progress=False, batch_size=4,
                    **{**DECODE, "gen_length": 32})
    manager = TaskManager(include_path=[str(include), str(local_task[1])], include_defaults=False)
    cache = str(tmp_path / "cache")
    lm = LocalLeapLM(model=embedded, stats_path=cache + ".stats.jsonl", **settings)
    # a generation task and a likelihood task in one run
    res = lm_eval.simple_evaluate(model=lm, tasks=[name, local_task[0]], task_manager=manager, num_fewshot=0,
                                  limit=6, log_samples=True, bootstrap_iters=0, use_cache=cache)
    samples = res["samples"][name]
    assert len(samples) == 6 and len(res["samples"][local_task[0]]) == 12  # (gsm8k: two filters per item)
    pairs = [ll.encode_pair(embedded.tokenizer, *arg, family="llada") for s in samples for arg in s["arguments"]]
    direct = ll.loglikelihood(embedded, [c for c, _ in pairs], [y for _, y in pairs],
                              ll.LikelihoodConfig(mc_num=16, batch_size=8, cfg_scale=0.5))
    logged = np.array([r[0][0] for s in samples for r in s["resps"]])
    assert np.array_equal(logged, direct)  # what lm-eval scored is ll.loglikelihood on the authors' pairs
    per_item = logged.reshape(6, 4)
    accuracy = np.mean([np.argmax(row) == s["target"] for row, s in zip(per_item, samples)])
    assert res["results"][name]["acc,none"] == pytest.approx(accuracy)
    stats = [json.loads(line) for line in open(cache + ".stats.jsonl")]
    assert sum(r.get("kind") == "loglikelihood" for r in stats) == 24 and all(r["seconds"] > 0 for r in stats
                                                                              if r.get("kind") == "loglikelihood")
    again = LocalLeapLM(model=embedded, stats_path=cache + ".stats.jsonl", **settings)
    res2 = lm_eval.simple_evaluate(model=again, tasks=[name, local_task[0]], task_manager=manager, num_fewshot=0,
                                   limit=6, log_samples=True, bootstrap_iters=0, use_cache=cache)
    assert again.model_calls == 0  # everything came from the cache
    assert res2["results"][name]["acc,none"] == res["results"][name]["acc,none"]
    other = LocalLeapLM(model=embedded, **{**settings, "mc_num": 8})
    with pytest.raises(CacheMismatchError, match="likelihood.mc_num"):  # other estimator settings: not its cache
        lm_eval.simple_evaluate(model=other, tasks=[name], task_manager=manager, num_fewshot=0, limit=1,
                                bootstrap_iters=0, use_cache=cache)


def test_is_check_greedy_and_rolling_windows(embedded):
    from lm_eval.api.instance import Instance

    lm = LocalLeapLM(model=embedded, compile_cache=False, progress=False, mc_num=8, mc_batch_size=8,
                     is_check_greedy=True)
    lm.set_cache_hook(lm_eval_cache_hook())
    # (a context ending in no whitespace: the authors' split moves trailing whitespace into the continuation)
    context = embedded.tokenizer.chat("Mia has 3 apples. She gets 4 more apples. How many apples does Mia have now?")
    context = context.rstrip() + "\n\nMia"
    ids, mask = embedded.tokenizer.encode_batch([context], chat=False)
    out = ll.generate(embedded, ids, mask, ll.DecodeConfig(strategy=ll.rule("low_confidence", steps=4), gen_length=4,
                                                           block_length=4))
    greedy_ids = out.tokens[0, out.prompt_length:].tolist()
    greedy_text = embedded.tokenizer.hf.decode(greedy_ids)  # what the greedy check decodes
    assert ll.encode_pair(embedded.tokenizer, context, greedy_text)[1] == greedy_ids  # the same ids come back
    out = lm.loglikelihood([Instance("loglikelihood", {}, (context, greedy_text), 0),
                            Instance("loglikelihood", {}, (context, "zzzz qqq"), 1)])
    greedy = ll.loglikelihood(embedded, *zip(*[ll.encode_pair(embedded.tokenizer, context, y)
                                               for y in (greedy_text, "zzzz qqq")]), greedy=True)
    assert [g for _, g in out] == greedy.tolist() == [True, False], greedy_text
    text = "Mia has 3 apples. " * 120  # longer than the model: several windows
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert total < 0 and sum(r["kind"] == "loglikelihood_rolling" for r in lm.stats.values()) > 1


def lm_eval_cache_hook():
    from lm_eval.api.model import CacheHook

    return CacheHook(None)


def test_the_command_line_takes_a_users_rule_by_name_and_refuses_its_old_answers_after_an_edit(local_task, tmp_path,
                                                                                               capfd, monkeypatch):
    """Issue #22: model_args rules=FILE, the rule by name (its own setting beside it), its code in the answers' key."""
    import lm_eval.tasks
    from sqlitedict import SqliteDict

    class LocalTasksOnly(lm_eval.tasks.TaskManager):  # the local task includes the stock gsm8k.yaml by path:
        def __init__(self, *args, **kwargs):            # indexing every stock task would cost ~15 s a run
            super().__init__(*args, **{"include_defaults": False, **kwargs})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasksOnly)

    from helpers import command_line_state_put_back, rules_put_back, write_user_rules
    from localleap_jax.lm_eval import CACHE_OWNER, main, read_stats

    rules, (task, include) = write_user_rules(tmp_path / "myrules.py"), local_task
    argv = ["--model", "localleap", "--model_args",
            f"checkpoint=embedded,rules={rules},strategy=steady,k=3,gen_length=16,block_length=16,"
            f"compile_cache=false,progress=false,stats_path={tmp_path / 'stats.jsonl'}",
            "--tasks", task, "--include_path", str(include), "--num_fewshot", "0", "--limit", "2",
            "--use_cache", str(tmp_path / "cache")]
    with rules_put_back(), command_line_state_put_back():
        assert main(argv) == 0
        with SqliteDict(str(tmp_path / "cache_rank0.db")) as db:
            decode = db[CACHE_OWNER]["decode"]
        assert decode["rule"] == "steady:k=3"
        assert decode["rule_code"] == ll.rules.code_identity(ll.rule("steady"))["code"]
        assert len(read_stats(tmp_path / "stats.jsonl")) == 2
        write_user_rules(rules, edited=True)
        capfd.readouterr()
        assert main(argv) == 2  # the answers in the cache are the old code's: refused, never reported
        lines = capfd.readouterr().err.strip().splitlines()
        assert re.fullmatch(r"error: the response cache \S+ holds answers of another setup \(decode\.rule_code "
                            r"differ\); use another --use_cache path", lines[-1]), lines[-3:]
        assert len(read_stats(tmp_path / "stats.jsonl")) == 2  # nothing generated


def test_the_adapter_takes_the_checkpoints_own_canvas_unless_the_model_args_name_one():
    """Issue #47: `--model_args checkpoint=embedded,...` decoded at the papers' gen 256 / block 32, where the embedded
    model's manifest says gen 64 / block 16 (eval_gsm8k.py reads it): every prompt of the README's command was too
    long. The adapter reads the manifest too; what the model arguments name wins."""
    own = LocalLeapLM(checkpoint="embedded", compile_cache=False, progress=False)
    assert (own.cfg.gen_length, own.cfg.block_length) == (64, 16)
    given = LocalLeapLM(model=own.model, checkpoint="embedded", gen_length=32, compile_cache=False, progress=False)
    assert (given.cfg.gen_length, given.cfg.block_length) == (32, 32)  # a model passed in: no manifest read
    chain = LocalLeapLM(checkpoint="embedded-chain", block_length=8, compile_cache=False, progress=False)
    assert (chain.cfg.gen_length, chain.cfg.block_length) == (80, 8)  # its own gen 80; the block given
