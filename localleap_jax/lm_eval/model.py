"""The lm-eval model `localleap` (LocalLeapLM): lm-eval owns tasks, prompts, filters and metrics; this generates
and scores.

`generate_until`: each request's context (the whole few-shot string) becomes one user turn of the
chat template, as the LLaDA/Fast-dLLM/LocalLeap evaluations did; requests are sorted by length
and batched with left padding (prompt lengths are bucketed by `generate`, so a task compiles a
handful of programs); every batch runs across all local devices (pmap), or on the mesh of a
multi-process run; the output is cut at the request's `until` strings. After every batch the
per-request NFE/seconds go to `stats_path` and then the answers to lm-eval's cache hook (so
`--use_cache` resumes an interrupted run, and an answer is never cached without its stats).

`loglikelihood` (multiple-choice tasks): each (context, continuation) is split into ids as the family's authors
do (`likelihood.encode_pair`: plain tokenization, no chat template) and scored by the family's Monte-Carlo
estimator (`ll.loglikelihood`, model_args mc_num, mc_batch_size, cfg, estimator), in chunks whose results, after
their stats, go to the cache hook as generations do. `is_greedy` is LLaDA's greedy-suffix check with
`is_check_greedy=true`, else False (as in the authors' runs). `loglikelihood_rolling` (perplexity tasks) cuts the
text into lm-eval's disjoint rolling windows of the model's length and sums the windows' estimates: each
window's ELBO bounds its log-likelihood from below, so the sum bounds the text's. A family without an estimator
(`Family.likelihood` None: DiffusionGemma, the block-diffusion families) refuses both in one line naming why.

A uniform-noise canvas model (DiffusionGemma) decodes the same way with a canvas rule: without model_args
`strategy` its family's first (entropy_bound), blocks of its canvas_length and gen_length rounded up to whole
canvases unless given (`args.fit_to_model`); its draws come from `seed` (a key per compiled call, folded with
each prompt's place in it), and a task that asks to sample at a temperature is refused (the rule has its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from localleap_jax import cli
from localleap_jax.api import generate
from localleap_jax.checkpoint import Model
from localleap_jax.compile_cache import enable_compilation_cache
from localleap_jax.resolve import resolve_checkpoint
from localleap_jax.decode import DecodeConfig, DecodeError
from localleap_jax.decode.progress import rows_finished
from localleap_jax.dist.multihost import leader
from localleap_jax.lm_eval.args import (check_batching, check_gen_length, default_dtype, fit_to_model,
                                       parse_model_args, refuse_python_only, with_checkpoint_defaults)
from localleap_jax.lm_eval.devices import join_and_mesh
from localleap_jax.lm_eval.identity import answers_key, claim_cache, forget_missing_answers
from localleap_jax.lm_eval.prompts import Prompt, cut_at_until, fit_all
from localleap_jax.lm_eval.stats import append_stats, open_stats, pair_key, prompt_key
from localleap_jax.families import read_config_file
from localleap_jax.likelihood import LikelihoodError, encode_pair
from localleap_jax.tokenizer import cut_at_stop, left_pad


# Likelihood requests are scored in chunks of this many compiled calls (LikelihoodConfig.requests_per_call requests
# each), each chunk cached as it ends: what an interrupted run keeps.
LIKELIHOOD_CHUNK_CALLS = 4


class _Shown:
    """One compiled call's rows on the progress bar: those the call reports as they finish, with the passes it has
    run (`finished`, after every pass, on the runtime's thread: the bar moves within seconds, before any row is
    done), then the rest once it returns (`rest`)."""

    REDRAW_S = 0.5  # the pass count is redrawn at most this often

    def __init__(self, bar, rows: int):
        self.bar, self.rows, self.done, self.passes, self.drawn = bar, rows, 0, 0, 0.0

    def finished(self, n: int, passes: int = 0) -> None:
        n = min(n, self.rows - self.done)  # a data shard's padding rows finish too: never past the call's rows
        self.done += n
        if passes > self.passes:
            self.passes = passes
            now = time.monotonic()
            redraw = now - self.drawn >= self.REDRAW_S and not n  # (an update below redraws anyway)
            self.drawn = now if redraw or n else self.drawn
            self.bar.set_postfix_str(f"pass {passes}", refresh=redraw)
        if n:
            self.bar.update(n)

    def rest(self) -> None:
        self.finished(self.rows - self.done)


@contextlib.contextmanager
def _nothing():
    yield


@register_model("localleap")
class LocalLeapLM(LM):
    """A checkpoint (any family) decoded by `localleap_jax.generate`.

    Model arguments: those in ADAPTER_ARGS, every DecodeConfig field and the rules' shared settings (kappa, tau,
    radius, steps). `model` (a loaded Model), `on_batch` (called after each batch) and `answers_key` (a caller's
    resume key, see `answers_key`) are for Python callers."""

    def __init__(self, model: Model | None = None, on_batch: Callable | None = None,
                 answers_key: dict | None = None, **model_args: Any):
        super().__init__()
        settings, self.cfg = parse_model_args(model_args)
        if settings["compile_cache"]:
            enable_compilation_cache()
        self.batch_size = settings["batch_size"]
        # the rows the loop holds at once, and the prompts per compiled call (refused when it would leave slots idle)
        self.slots, self.queue = check_batching(self.batch_size, settings["slots"], settings["queue"])
        self.chat = settings["chat"]
        self.seed = settings["seed"]
        self.progress = settings["progress"]
        self.truncate_fewshot = settings["truncate_fewshot"]
        self.fewshot_delimiter = settings["fewshot_delimiter"]
        self.stats_path = Path(settings["stats_path"]) if settings["stats_path"] else None
        self.stats = {} if self.stats_path is None else open_stats(self.stats_path)
        self.likelihood = settings["likelihood"]
        self.check_greedy = settings["is_check_greedy"]
        self.add_bos_token = settings["add_bos_token"]
        self.mesh = join_and_mesh(settings)
        if model is None:
            dtype = settings["dtype"]
            path = resolve_checkpoint(settings["checkpoint"])
            if (path / "config.json").is_file():  # the settings fitted to the model before any weight is read
                self.cfg = with_checkpoint_defaults(self.cfg, path, model_args)
                fit_to_model(self.cfg, read_config_file(path / "config.json"), given=model_args)
            model = leader().load(path, dtype=default_dtype() if dtype == "auto" else dtype, mesh=self.mesh)
        self.cfg = fit_to_model(self.cfg, model.config, given=model_args)
        check_gen_length(self.cfg, model.config.max_sequence_length)
        self.model = model
        self.rng = jax.random.key(self.seed)
        self.on_batch = on_batch
        self._answers_key = answers_key
        self.model_calls = 0  # batches generated by this instance (0 when everything came from the cache)
        self.rows_generated = 0  # requests answered by this instance
        self._totals = [0, 0, 0, 0.0]  # rows, NFE, tokens, seconds generated (for the progress bar)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LocalLeapLM:
        # lm-eval passes its --batch_size/--device beside --model_args; a key in both is taken from
        # --model_args (lm-eval itself would fail on the duplicate keyword).
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        given = {**extra, **arg_dict}
        refuse_python_only(given)
        return cls(**given)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LocalLeapLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def batching(self) -> dict:
        """How this instance lays out its compiled calls (what its timings depend on besides the model and rule);
        each generated row's stats record it, so a row reused from an earlier run is known by its own."""
        return {"batch_size": self.batch_size, "slots": self.slots, "queue": self.queue,
                "devices": jax.local_device_count(), "mesh": None if self.mesh is None else dict(self.mesh.shape)}

    @property
    def answers_key(self) -> dict:
        """What this instance's answers depend on (computed on first use: it hashes the weights' identity)."""
        if self._answers_key is None:
            batch = {"batch_size": self.batch_size, "slots": self.slots, "queue": self.queue,
                     "devices": jax.local_device_count(),
                     "mesh": None if self.mesh is None else dict(self.mesh.shape)}
            delimiter = self.fewshot_delimiter if self.truncate_fewshot else False
            self._answers_key = answers_key(self.model, self.cfg, chat=self.chat, seed=self.seed,
                                            truncate_fewshot=delimiter, batch=batch,
                                            likelihood=self._likelihood_identity())
        return self._answers_key

    # ---------------------------------------------------------------- lm-eval API

    @property
    def tokenizer_name(self) -> str:
        return str(self.model.path or "localleap").replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.model.tokenizer.hf.apply_chat_template(chat_history, tokenize=False,
                                                           add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.model.tokenizer.hf.chat_template

    def set_cache_hook(self, cache_hook) -> None:
        """lm-eval hands over its response cache here, before any request: claim it for this setup and
        drop entries that hold no answer, so they are generated again instead of failing the run."""
        super().set_cache_hook(cache_hook)
        db = getattr(cache_hook, "dbdict", None)
        if db is None:
            return
        claim_cache(db, self.answers_key)
        dropped = forget_missing_answers(db)
        if dropped:
            print(f"note: {db.filename}: {dropped} cached requests had no answer; generating them again",
                  file=sys.stderr)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if not requests:
            return []
        self._check_likelihood("loglikelihood", requests)
        family = self.model.config.family
        pairs = [encode_pair(self.model.tokenizer, *r.args[:2], family=family, add_bos_token=self.add_bos_token)
                 for r in requests]
        keys = [pair_key(*r.args[:2]) for r in requests]

        def cache(lo: int, chunk_results) -> None:  # each chunk as it is scored: an interrupted run keeps it
            for r, result in zip(requests[lo:lo + len(chunk_results)], chunk_results):
                self.cache_hook.add_partial("loglikelihood", r.args, result)

        return self._score(pairs, keys, "loglikelihood", disable_tqdm, with_greedy=self.check_greedy, on_chunk=cache)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        if not requests:
            return []
        self._check_likelihood("loglikelihood_rolling", requests)
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        hf = self.model.tokenizer.hf
        prefix = hf.bos_token_id if hf.bos_token_id is not None else self.model.config.eos_token_id
        ends_with_eos = self.model.family.pairs_end_with_eos
        # a window is its context and at most max_seq_len tokens (one more than a causal model reads); Dream's end with EOS
        room = self.model.config.max_sequence_length - 1 - (1 if ends_with_eos else 0)
        pairs, keys, owner = [], [], []
        for n, r in enumerate(requests):
            tokens = hf(r.args[0], add_special_tokens=False)["input_ids"]
            for w, window in enumerate(get_rolling_token_windows(token_list=tokens, prefix_token=prefix,
                                                                  max_seq_len=room, context_len=1)):
                context, continuation = make_disjoint_window(window)
                pairs.append((list(context), list(continuation) + ([hf.eos_token_id] if ends_with_eos else [])))
                keys.append(pair_key(r.args[0], f"rolling window {w}"))
                owner.append(n)
        totals = [0.0] * len(requests)
        windows_left = [owner.count(n) for n in range(len(requests))]

        def cache(lo: int, chunk_results) -> None:  # a text once its last window is scored: an interrupted run keeps it
            for n, (value, _) in zip(owner[lo:lo + len(chunk_results)], chunk_results):
                totals[n] += value
                windows_left[n] -= 1
                if not windows_left[n]:
                    self.cache_hook.add_partial("loglikelihood_rolling", requests[n].args, totals[n])

        self._score(pairs, keys, "loglikelihood_rolling", disable_tqdm, with_greedy=False, on_chunk=cache)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        prompts = self._fit_prompts(requests)  # refuses over-long prompts before any generation
        self._check_configs(requests)  # and what a request asks that the rule cannot do
        order = sorted(range(len(requests)), key=lambda i: (-len(prompts[i].ids), i))
        results: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=f"generate [{self.cfg.rule.spec()}]", dynamic_ncols=True,
                   disable=disable_tqdm or not self.progress)
        try:  # closed however the loop ends, so an interrupted run's last line is not a stray bar
            # A Ctrl-C stops the work between two compiled calls, each call's answers cached (cli: a call that does
            # not end within seconds is abandoned, what was cached kept).
            with cli.stopping_between_steps():
                for start in range(0, len(order), self.queue):
                    cli.stop_if_asked()
                    batch = order[start:start + self.queue]
                    shown = _Shown(bar, len(batch))  # a queue's rows move the bar as they finish, inside the call
                    results_of_batch, stats_rows = self._generate_batch(requests, prompts, batch, start, shown)
                    self._append_stats(stats_rows)  # stats first: an answer is cached only once its stats are on disk
                    for i, text in zip(batch, results_of_batch):
                        results[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    self.rows_generated += len(batch)
                    if self.on_batch is not None:
                        self.on_batch([requests[i] for i in batch], results_of_batch, stats_rows)
                    shown.rest()
                    bar.set_postfix(**self._running_totals(), **(getattr(self.on_batch, "postfix", None) or {}))
        finally:
            bar.close()
        unanswered = [i for i, text in enumerate(results) if not isinstance(text, str)]
        if unanswered:  # lm-eval would cache and score the gap as an answer
            raise AssertionError(f"generate_until left {len(unanswered)} of {len(requests)} requests unanswered")
        return results

    # ---------------------------------------------------------------- helpers

    def _generate_batch(self, requests, prompts: list[Prompt], batch: list[int], start: int, shown=None
                        ) -> tuple[list[str], list[dict]]:
        """Answers (cut at `until`) and stats rows of one compiled call's requests: a fixed batch, or a queue
        through `slots` rows (continuous batching)."""
        tok = self.model.tokenizer
        cfg = self._config_for(requests[batch[0]].args[1])
        fixed = self.queue <= self.slots
        # A short last batch is filled up to the rows the loop holds with copies of its last row, so it runs the
        # program the full batches compiled (a second compile costs more than the filler rows: a copy decodes exactly
        # as its original, so the loop takes no extra step); the copies' answers are dropped. A queue is not: each
        # copy would take a slot's passes of its own.
        filled = batch + [batch[-1]] * (self.slots - len(batch)) if fixed else batch
        ids, mask = left_pad([prompts[i].ids for i in filled], tok.pad_id)
        rng = jax.random.fold_in(self.rng, start)
        slots = None if fixed else self.slots
        if self.mesh is None:  # one process: a full copy of the weights on each local device
            # With a progress bar, a queue's call reports its rows as they finish (decode/progress.py: a host
            # callback per pass; such a program is not kept in JAX's persistent cache, so model_args
            # progress=false runs the cached one).
            reporting = rows_finished(shown.finished) if shown is not None and slots and not shown.bar.disable else None
            with reporting or _nothing():
                out = generate(self.model, ids, mask, cfg, rng, devices=jax.local_devices(), slots=slots)
        else:  # every process at once, the batch split over "data", the weights over "model"
            out = leader().generate(self.model, ids, mask, cfg, rng, mesh=self.mesh, slots=slots)
        self.model_calls += 1
        generated = out.tokens[:len(batch), out.prompt_length:]
        texts = tok.decode_generated(generated, prompt_length=0)
        answers, rows = [], []
        for j, i in enumerate(batch):
            context, gen_kwargs = requests[i].args
            answers.append(cut_at_until(texts[j], gen_kwargs.get("until")))
            row = {"key": prompt_key(context), "nfe": int(out.nfe[j]), "seconds": out.seconds / len(batch),
                   "remasks": 0 if out.remasks is None else int(out.remasks[j]),
                   "edits": 0 if out.edits is None else int(out.edits[j]),
                   "inserts": 0 if out.inserts is None else int(out.inserts[j]),
                   "deletes": 0 if out.deletes is None else int(out.deletes[j]),
                   "hit_bound": bool(out.hit_bound[j]) if out.hit_bound is not None else False,
                   "prompt_tokens": len(prompts[i].ids), "fewshot_dropped": prompts[i].fewshot_dropped,
                   "generated_tokens": len(cut_at_stop(generated[j], tok.stop_ids)),
                   "compile_seconds": out.compile_seconds if j == 0 else 0.0, "batch_size": len(batch),
                   # the call's forward passes and rows held, shared out over its requests: summed over rows they
                   # give the run's passes and (with NFE) its occupancy, whatever the calls were
                   "passes_share": out.forward_passes / len(batch), "slots": out.slots, "batching": self.batching}
            self.stats[row["key"]] = row
            rows.append(row)
        self._totals = [t + v for t, v in zip(self._totals, (len(batch), sum(r["nfe"] for r in rows),
                                                              sum(r["generated_tokens"] for r in rows), out.seconds))]
        return answers, rows

    def _running_totals(self) -> dict:
        rows, nfe, tokens, seconds = self._totals
        return {"nfe": f"{nfe / max(rows, 1):.1f}", "tok_s": f"{tokens / max(seconds, 1e-9):.1f}"}

    def _fit_prompts(self, requests) -> list[Prompt]:
        """Every request's prompt, fitted beside the canvas or refused (all at once, before any work)."""
        return fit_all(requests, self.model.tokenizer, self.chat, self.truncate_fewshot, self.fewshot_delimiter,
                       self.model.config.max_sequence_length, self.cfg.gen_length)

    def _check_configs(self, requests) -> None:
        """Every request's DecodeConfig checked against the model before any generation: a task that asks to
        sample (do_sample with a temperature) is refused in one line for a canvas rule, which samples at its
        own temperature schedule."""
        for r in requests:
            cfg = self._config_for(r.args[1])
            if cfg is not self.cfg:
                try:
                    cfg.validate(self.model.config)
                except DecodeError as e:
                    raise DecodeError(f"the task's generation settings (do_sample, temperature="
                                      f"{r.args[1].get('temperature')}): {e}") from None

    def _check_likelihood(self, kind: str, requests) -> None:
        """A family without a likelihood estimator (DiffusionGemma, SDAR, ...) refuses log-likelihood requests in
        one line naming why, before any of them is encoded."""
        family = self.model.family
        if family.likelihood is None:
            raise LikelihoodError(f"{len(requests)} {kind} requests (a multiple-choice or perplexity task): "
                                  + (family.likelihood_refusal or f"likelihood of {family.title} models is not served")
                                  + "; generation tasks (generate_until) run")

    def _config_for(self, gen_kwargs: dict) -> DecodeConfig:
        if gen_kwargs.get("do_sample") and float(gen_kwargs.get("temperature") or 0) > 0:
            return dataclasses.replace(self.cfg, temperature=float(gen_kwargs["temperature"]))
        return self.cfg

    def _append_stats(self, rows: list[dict]) -> None:
        if self.stats_path is not None:
            append_stats(self.stats_path, rows)

    def _likelihood_identity(self) -> dict:
        """What the log-likelihoods depend on (besides the weights and tokenizer the key holds already)."""
        identity = {k: v for k, v in self.likelihood.to_json().items() if k != "requests_per_call"}
        return {**identity, "is_check_greedy": self.check_greedy, "add_bos_token": self.add_bos_token}

    def _score(self, pairs, keys, kind: str, disable_tqdm: bool, with_greedy: bool,
               on_chunk: Callable[[int, list], None]) -> list[tuple[float, bool]]:
        """(estimate, is_greedy) per pair, in chunks: each chunk's stats reach the log, then `on_chunk(first pair,
        its results)` caches it, so a run stopped by Ctrl-C (between two chunks) keeps every chunk scored."""
        results: list[tuple[float, bool]] = []
        with cli.stopping_between_steps():
            bar = tqdm(total=len(pairs), desc=f"{kind} [mc_num={self.likelihood.mc_num}]", dynamic_ncols=True,
                       disable=disable_tqdm or not self.progress)
            try:
                size = LIKELIHOOD_CHUNK_CALLS * self.likelihood.requests_per_call
                for start in range(0, len(pairs), size):
                    cli.stop_if_asked()
                    chunk = pairs[start:start + size]
                    contexts, continuations = [c for c, _ in chunk], [y for _, y in chunk]
                    seconds = [0.0] * len(chunk)

                    def timed(group, values, s, seconds=seconds):
                        for i in group:
                            seconds[i] = s / len(group)
                        bar.update(len(group))

                    values = self._likelihoods(contexts, continuations, greedy=False, on_group=timed)
                    greedy = (self._likelihoods(contexts, continuations, greedy=True, on_group=None) if with_greedy
                              else [False] * len(chunk))
                    rows = [{"key": key, "kind": kind, "seconds": s, "context_tokens": len(c), "continuation_tokens": len(y),
                             "loglikelihood": float(v), "is_greedy": bool(g)}
                            for key, (c, y), v, g, s in zip(keys[start:start + len(chunk)], chunk, values, greedy, seconds)]
                    for row in rows:
                        self.stats[row["key"]] = row
                    self._append_stats(rows)
                    chunk_results = [(float(v), bool(g)) for v, g in zip(values, greedy)]
                    on_chunk(start, chunk_results)
                    results += chunk_results
                    self.model_calls += 1
                    self.rows_generated += len(chunk)
            finally:
                bar.close()
        return results

    def _likelihoods(self, contexts, continuations, *, greedy: bool, on_group):
        # One process: on this process's default device; several: on the mesh, every process at once.
        return leader().loglikelihood(self.model, contexts, continuations, self.likelihood, mesh=self.mesh,
                                      greedy=greedy, on_group=on_group)
