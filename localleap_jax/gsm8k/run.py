"""The lm-eval pass of one strategy: lm-eval's gsm8k task, filters and metric around LocalLeapLM, resumable
from a response cache named by everything the answers depend on; then its rows joined with our NFE and
timing stats, and their summary."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from pathlib import Path

import jax

from localleap_jax import processes
from localleap_jax.gsm8k.data import DataPlan, Task
from localleap_jax.errors import UserError
from localleap_jax.gsm8k.progress import Progress, RunningAccuracy
from localleap_jax.gsm8k.settings import EvalSettings
from localleap_jax.lm_eval import (USER_ERRORS, LocalLeapLM, PromptTooLongError, answers_key, check_response_cache,
                                   key_digest, prompt_key, response_cache_file)
from localleap_jax.rules.sources import code_identity, loaded_sources


def resume_key(model, cfg, settings: EvalSettings, data_id: str) -> dict:
    """What a strategy's answers depend on (see lm_eval.answers_key); its digest names the cache."""
    return answers_key(model, cfg, chat=True, seed=settings.seed, truncate_fewshot=settings.truncate_fewshot,
                       batch={"batch_size": settings.batch_size, "slots": settings.slots, "queue": settings.queue,
                              "limit": settings.limit,
                              "devices": jax.local_device_count(), "mesh": settings.mesh_shape},
                       task={"data": data_id, "num_fewshot": settings.num_fewshot})


def task_manager(include: Path | None):
    """lm-eval's task index. A local task includes the stock gsm8k.yaml by path, so the index needs only
    its own directory: indexing every stock task costs half a minute per strategy."""
    from lm_eval.tasks import TaskManager

    if include is None:
        return TaskManager()
    return TaskManager(include_path=str(include), include_defaults=False)


class _ExpectedNotes(logging.Filter):
    """lm-eval's notes about what this run asked for on purpose (the few-shot count it passes) are not
    problems: dropped, so the warnings that remain are real ones."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Overwriting default num_fewshot")


@contextlib.contextmanager
def expected_notes_silenced():
    import datasets

    log = logging.getLogger("lm_eval.evaluator")
    note = _ExpectedNotes()
    log.addFilter(note)
    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating test split": datasets reading the task's JSONL
    try:
        yield
    finally:
        log.removeFilter(note)
        if bars:
            datasets.enable_progress_bars()


def evaluate_once(model, cfg, key: dict, cache: Path, settings: EvalSettings, task: Task, progress: Progress):
    """One lm-eval pass of `cfg` over the task, resuming from the response cache `cache` (claimed with `key`);
    returns (its LocalLeapLM, lm-eval's samples)."""
    import lm_eval

    check_response_cache(response_cache_file(cache))  # a damaged file: one line naming it, before lm-eval opens it
    lm = LocalLeapLM(model=model, mesh=settings.mesh, answers_key=key, batch_size=settings.batch_size,
                     slots=settings.slots, queue=settings.queue,
                     stats_path=f"{cache}.stats.jsonl",
                     compile_cache=settings.compile_cache, seed=settings.seed, on_batch=RunningAccuracy(),
                     truncate_fewshot=settings.truncate_fewshot,
                     **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    progress.models.append(lm)
    try:
        with expected_notes_silenced():
            res = lm_eval.simple_evaluate(model=lm, tasks=[task.name], task_manager=task_manager(task.include),
                                          num_fewshot=settings.num_fewshot, limit=settings.limit,
                                          use_cache=str(cache), log_samples=True, bootstrap_iters=0,
                                          random_seed=settings.seed)
    except PromptTooLongError as e:
        raise UserError(f"{e.summary}; {prompt_fix(e, settings)}") from None
    except USER_ERRORS as e:
        raise UserError(str(e)) from None
    except (ConnectionError, OSError, FileNotFoundError) as e:
        if task.include is None:
            raise UserError(f"could not load GSM8K from the Hugging Face hub ({type(e).__name__}); offline, pass "
                            f"--data FILE.jsonl (e.g. ../shared/data/gsm8k/test.jsonl)") from None
        raise
    return lm, res["samples"][task.name]


def prompt_fix(e: PromptTooLongError, settings: EvalSettings) -> str:
    """What to do about prompts too long for the model, as flags that lead to a run: truncation where it makes every
    prompt fit; else the problems before the first whose question alone is too long, a shorter canvas (whole blocks),
    or a longer window."""
    if not e.bare:
        return "pass --truncate-fewshot to drop few-shot examples, or lower --num-fewshot or --gen-length"
    first, longest = e.bare[0][0], max(n for _, n in e.bare)
    why = ("even with every few-shot example dropped," if e.truncating or settings.num_fewshot else
           "0-shot: there is no few-shot example to drop, and")
    alone = "its question alone is" if len(e.bare) == 1 else f"{len(e.bare)} questions alone are"
    also = " --truncate-fewshot" if len(e.bare) < e.too_long and not e.truncating else ""  # it fits the others
    ways = [f"--limit {first}{also} evaluates the problems before the first of them (problem {first})"] if first else []
    room = e.max_sequence_length - longest
    gen = room - room % settings.block_length  # the canvas is cut into whole blocks
    if gen > 0:
        ways.append(f"--gen-length {gen}{also} leaves room for the longest ({longest} tokens)")
    ways.append(f"a model with a window longer than {e.max_sequence_length} tokens holds them")
    return f"{why} {alone} too long: " + "; or ".join(ways)


def forget_answers(lm, samples: list[dict]) -> None:
    """Delete these samples' answers from the response cache, so the next pass generates them again."""
    from lm_eval.api.model import hash_args

    db = lm.cache_hook.dbdict
    for s in samples:
        db.pop(hash_args("generate_until", s["arguments"][0]), None)
    db.commit()


def run_strategy(model, strategy: str, settings: EvalSettings, task: Task, out: Path, progress: Progress):
    """lm-eval on one strategy; returns (LocalLeapLM of the last pass, samples, batches generated)."""
    cfg = settings.decode_config(strategy)
    key = resume_key(model, cfg, settings, task.data_id)
    cache = out / "cache" / f"{re.sub(r'[^A-Za-z0-9_.=-]+', '_', strategy)}-{key_digest(key)[:12]}"
    batches = 0
    for _ in range(2):
        lm, samples = evaluate_once(model, cfg, key, cache, settings, task, progress)
        batches += lm.model_calls
        # An answer whose stats were lost (a torn stats log) is generated again, once: every row
        # reported has its NFE and time.
        unmeasured = [s for s in samples if prompt_key(s["arguments"][0][0]) not in lm.stats]
        if not unmeasured:
            return lm, samples, batches
        forget_answers(lm, unmeasured)
    raise AssertionError(f"{len(unmeasured)} answers still have no stats after generating them again")


def collect(strategy: str, lm, samples: list[dict]) -> list[dict]:
    """One row per problem: lm-eval's filtered answers and scores, joined with our NFE/timing stats."""
    by_doc: dict[int, dict] = {}
    for s in samples:
        context, generated = s["arguments"][0][0], s["resps"][0][0]
        if not isinstance(generated, str):  # never report a missing answer as a wrong one
            raise AssertionError(f"lm-eval returned no answer for problem {s['doc_id']} ({generated!r})")
        row = by_doc.setdefault(s["doc_id"], {
            "id": s["doc"].get("id", s["doc_id"]), "strategy": strategy,
            "question": s["doc"]["question"], "generated": generated,
            "gold": str(s["doc"]["answer"]).split("####")[-1].strip(), "_key": prompt_key(context)})
        tag = "strict" if s["filter"] == "strict-match" else "flexible"
        row[f"filtered_{tag}"] = s["filtered_resps"][0]
        row[f"correct_{tag}"] = bool(s["exact_match"])
    rows = []
    for doc_id in sorted(by_doc):
        row = by_doc[doc_id]
        st = lm.stats[row.pop("_key")]
        row.update(prompt_tokens=st.get("prompt_tokens"), fewshot_dropped=st.get("fewshot_dropped", 0),
                   nfe=st.get("nfe"), remasks=st.get("remasks", 0), edits=st.get("edits", 0),
                   inserts=st.get("inserts", 0), deletes=st.get("deletes", 0),
                   hit_bound=st.get("hit_bound", False),
                   seconds=st.get("seconds"),
                   generated_tokens=st.get("generated_tokens"), compile_seconds=st.get("compile_seconds", 0.0),
                   passes_share=st.get("passes_share"), slots=st.get("slots"),
                   # the batch settings its answer was generated (and timed) with: an earlier run's when it came from
                   # the response cache (answers that do not depend on them are reused across batch settings)
                   batching=st.get("batching"), timed_here=st.get("batching") == lm.batching)
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    seconds = sum(r["seconds"] for r in rows)
    return {
        "n": n,
        "accuracy_strict": sum(r["correct_strict"] for r in rows) / n,
        "accuracy_flexible": sum(r["correct_flexible"] for r in rows) / n,
        "mean_nfe": sum(r["nfe"] for r in rows) / n,
        "mean_remasks": sum(r.get("remasks") or 0 for r in rows) / n,  # tokens taken back (rules that revoke)
        "mean_edits": sum(r.get("edits") or 0 for r in rows) / n,  # tokens replaced by others (rules that edit)
        "mean_inserts": sum(r.get("inserts") or 0 for r in rows) / n,  # positions inserted (LLaDA2.2's SPLIT)
        "mean_deletes": sum(r.get("deletes") or 0 for r in rows) / n,  # positions dropped (LLaDA2.2's DELETE)
        "hit_bound": sum(bool(r.get("hit_bound")) for r in rows),  # answers stopped by max_passes with masks left
        "tokens_per_second": sum(r["generated_tokens"] for r in rows) / max(seconds, 1e-9),
        "seconds_per_sample": seconds / n,
        "compile_seconds": sum(r["compile_seconds"] or 0.0 for r in rows),
        "truncated": sum(r["fewshot_dropped"] > 0 for r in rows),  # prompts that lost few-shot examples
        # rows generated by an earlier run with other batch settings (reused answers): the timings are that run's
        "timed_elsewhere": sum(not r.get("timed_here", True) for r in rows),
        "timed_with": [b for b in _distinct(r.get("batching") for r in rows if not r.get("timed_here", True))],
        **loop_usage(rows),
    }


def _distinct(items) -> list:
    out = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def loop_usage(rows: list[dict]) -> dict:
    """The forward passes the compiled calls ran for these rows, and the slot occupancy: the share of the rows
    held x passes that did work (sum of NFE over it). Each row carries its share of its call's passes; rows whose
    stats predate these fields are left out (None when none has them)."""
    known = [r for r in rows if r.get("passes_share") is not None and r.get("slots")]
    if not known:
        return {"passes": None, "occupancy": None}
    held = sum(r["passes_share"] * r["slots"] for r in known)
    return {"passes": round(sum(r["passes_share"] for r in known), 3),
            "occupancy": sum(r["nfe"] for r in known) / max(held, 1e-9)}


def rule_record(cfg) -> dict:
    """What a summary records of the rule a strategy ran: its full spec (every setting, the shared flags folded
    in), the digest of its code that its resume key holds, and where that code is."""
    identity = code_identity(cfg.rule)
    return {"spec": cfg.rule.spec(), "rule_code": identity["code"], "rule_defined_in": identity["defined_in"]}


def config_record(settings: EvalSettings, cache: str, path: Path, model, plan: DataPlan, task: Task) -> dict:
    """The run's settings as its summary records them (`cache`: the --cache flag as given)."""
    return {"checkpoint": str(path), "dtype": str(model.dtype), "data": plan.description, "task": task.name,
            "num_fewshot": settings.num_fewshot,
            "truncate_fewshot": settings.truncate_fewshot, "gen_length": settings.gen_length,
            "block_length": settings.block_length, "steps": settings.steps, "kappa": settings.kappa,
            "tau": settings.tau, "radius": settings.radius, "cache": cache, "early_stop": settings.early_stop,
            "limit": settings.limit, "batch_size": settings.batch_size, "slots": settings.slots,
            "queue": settings.queue, "seed": settings.seed,
            "mesh": settings.mesh_shape, "processes": _process_count(),
            "rule_sources": [s.to_json() for s in loaded_sources()]}  # --rules files and modules, entry points


def _process_count() -> int:
    return processes.process_count() if processes.is_multiprocess() else 1
