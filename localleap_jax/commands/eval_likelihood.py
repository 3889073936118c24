"""Multiple-choice tasks scored by log-likelihood (the authors' Monte-Carlo ELBO), through lm-eval.

    python experiments/eval_likelihood.py                          # tiny-math on an offline choice task
    python experiments/eval_likelihood.py --checkpoint DIR --tasks paper --limit 200    # LLaDA's task list (hub)
    python experiments/eval_likelihood.py --tasks arc_challenge:0:0.5,piqa --mc-num 128

`--tasks paper` is LLaDA's `eval.sh` list (task, few-shot, cfg, mc_num): gpqa_main_n_shot 5 0.5 128,
truthfulqa_mc2 0 2.0 128, arc_challenge 0 0.5 128, hellaswag 0 0.5 128, winogrande 5 0.0 128, piqa 0 0.5 128,
mmlu 5 0.0 1 (their MC mini-batch: 8, and 1 for mmlu). `--tasks local` (the default for the embedded model) is
`localleap_jax.lm_eval.choice_task`: the synthetic-math test split with its right answer among three wrong ones.
A task may be NAME[:SHOTS[:CFG[:MC_NUM]]]. Results: OUT/summary.json and a table; lm-eval's response cache per
task under OUT/cache, written as the requests are scored, so an interrupted run resumes where it stopped (rerun the
same command). One run holds OUT at a time (OUT/.lock, as eval_gsm8k's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from localleap_jax import cli
from localleap_jax.checkpoint import EMBEDDED
from localleap_jax.cli import whole_number
from localleap_jax.gsm8k import (Progress, UserError, check_output, default_output, exit_status, find_checkpoint,
                                 holding, load_model, read_model_config, write_atomically)
from localleap_jax.lm_eval import USER_ERRORS, CacheMismatchError

RESULTS = Path("results")  # the default --output's parent, under the current directory
# LLaDA's evaluation/eval.sh: (task, few-shot, cfg, mc_num, their --batch_size = the MC mini-batch)
PAPER_TASKS = [("gpqa_main_n_shot", 5, 0.5, 128, 8), ("truthfulqa_mc2", 0, 2.0, 128, 8),
               ("arc_challenge", 0, 0.5, 128, 8), ("hellaswag", 0, 0.5, 128, 8), ("winogrande", 5, 0.0, 128, 8),
               ("piqa", 0, 0.5, 128, 8), ("mmlu", 5, 0.0, 1, 1)]


def parse_tasks(text: str, mc_num: int | None, mc_batch: int | None, cfg: float | None) -> list[tuple]:
    """(task, shots, cfg, mc_num, mc_batch) per task; command-line values override the table's. A --mc-num the
    table's mini-batch does not divide takes the largest mini-batch below it that does."""
    out = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        if item == "paper":
            out += PAPER_TASKS
            continue
        if item == "local":
            out.append(("local", 0, 0.0, 128, 32))
            continue
        name, *rest = item.split(":")
        if len(rest) > 3 or not name:
            raise UserError(f"--tasks {item!r}: expected NAME[:SHOTS[:CFG[:MC_NUM]]]")
        try:
            shots = int(rest[0]) if len(rest) > 0 else 0
            guide = float(rest[1]) if len(rest) > 1 else 0.0
            mc = int(rest[2]) if len(rest) > 2 else 128
        except ValueError:
            raise UserError(f"--tasks {item!r}: expected NAME[:SHOTS[:CFG[:MC_NUM]]]") from None
        if shots < 0 or mc < 1 or not math.isfinite(guide) or guide < 0:
            raise UserError(f"--tasks {item!r}: shots >= 0, cfg a finite number >= 0 and mc_num >= 1")
        out.append((name, shots, guide, mc, min(32, mc)))
    if not out:
        raise UserError("--tasks names no task")
    if cfg is not None and (not math.isfinite(cfg) or cfg < 0):
        raise UserError(f"--cfg {cfg}: expected a finite number >= 0 (0: no guidance)")
    tasks = []
    for name, shots, guide, mc, batch in out:
        mc = mc_num or mc
        if mc_batch is not None:
            batch = mc_batch
        elif mc % batch:
            batch = max(d for d in range(1, batch + 1) if mc % d == 0)
        if mc % batch:
            raise UserError(f"--mc-num {mc} is not a multiple of --mc-batch-size {batch} (the samples are drawn in "
                            "whole mini-batches)")
        tasks.append((name, shots, guide if cfg is None else cfg, mc, batch))
    return tasks


def parse_args(argv=None):
    ap = cli.OneLineParser(prog="python experiments/eval_likelihood.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="converted checkpoint dir or hub id (default: embedded, "
                    "tiny-math: the local task is built from its problems)")
    ap.add_argument("--tasks", default=None, help="'local', 'paper' or NAME[:SHOTS[:CFG[:MC_NUM]]],... "
                                                  "(default: local for the embedded model, else paper)")
    ap.add_argument("--limit", type=whole_number(1, "a positive integer"), default=None, help="items per task")
    ap.add_argument("--mc-num", type=whole_number(1, "a positive integer"), default=None,
                    help="Monte-Carlo samples per request (default: the task table's, 128)")
    ap.add_argument("--mc-batch-size", type=whole_number(1, "a positive integer"), default=None,
                    help="Monte-Carlo mini-batch (default: the task table's)")
    ap.add_argument("--cfg", type=float, default=None, help="guidance for every task (default: the table's)")
    ap.add_argument("--n-local", type=whole_number(4, "an integer >= 4"), default=200,
                    help="items of the local choice task (default 200)")
    ap.add_argument("--dtype", default="auto", choices=cli.DTYPES, help=cli.DTYPE_HELP)
    ap.add_argument("--seed", type=whole_number(0, "an integer >= 0"), default=0)
    ap.add_argument("--output", default=None, help="output directory (default: results/likelihood-<checkpoint>-<8 hex of its "
                    "weights' fingerprint>-<8 hex of the tasks and settings>, under the current directory)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap.parse_args(argv)


def check_tasks(tasks: list[tuple], manager) -> None:
    """Every stock task named is one lm-eval knows (`manager`: its index, built once), the closest names suggested;
    refused before anything is created (lm-eval would first make the response cache, then fail)."""
    import difflib

    known = set(manager.all_tasks)
    unknown = [name for name, *_ in tasks if name != "local" and name not in known]
    if unknown:
        near = {n: difflib.get_close_matches(n, known, n=3) for n in unknown}
        said = "; ".join(f"{n}" + (f" (did you mean {', '.join(near[n])}?)" if near[n] else "") for n in unknown)
        raise UserError(f"--tasks: lm-eval knows no task {said}; `python -m localleap_jax.lm_eval ls tasks` lists them, "
                        "and --tasks local runs offline")


def evaluate(args, progress: Progress) -> int:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from localleap_jax.families import family_of
    from localleap_jax.lm_eval import LocalLeapLM, check_response_cache, response_cache_file
    from localleap_jax.lm_eval.choice_task import write_choice_task

    # Everything that can be checked is checked before anything is created or loaded.
    path, manifest = find_checkpoint(args.checkpoint)
    config = read_model_config(path)
    if config.block_causal:
        raise UserError(f"{path.name} is a block-diffusion model (block-causal attention): its authors publish no "
                        "likelihood estimator, and none is served here")
    family = family_of(config)
    if family.likelihood is None:
        raise UserError(f"{path.name}: " + (family.likelihood_refusal or
                                            f"likelihood of {family.title} models is not served"))
    embedded = path == EMBEDDED
    tasks = parse_tasks(args.tasks or ("local" if embedded else "paper"), args.mc_num, args.mc_batch_size, args.cfg)
    # The default --output is the model's and this run's (the tasks with their settings, ...): a run that would give
    # other results never replaces another's summary.
    run = {"tasks": tasks, "limit": args.limit, "n_local": args.n_local, "seed": args.seed, "dtype": args.dtype}
    out = Path(args.output or default_output(RESULTS, path, manifest, prefix="likelihood-", run=run))
    out = out.expanduser().resolve()
    check_output(out)
    stock = None
    if any(name != "local" for name, *_ in tasks):
        stock = TaskManager()  # lm-eval's index of its tasks, built once (tens of seconds)
        check_tasks(tasks, stock)
    for name, *_ in tasks:
        check_response_cache(response_cache_file(out / "cache" / name))

    with holding(out, progress):  # one run at a time writes into OUT (as eval_gsm8k and analyze_dynamics)
        model = load_model(path, args.dtype)
        summary = {"checkpoint": str(path), "tasks": {}}
        for name, shots, guide, mc, batch in tasks:
            manager = stock
            if name == "local":
                name, include = write_choice_task(out / "local", model.tokenizer, args.n_local, args.seed)
                manager = TaskManager(include_path=str(include), include_defaults=False)
                check_response_cache(response_cache_file(out / "cache" / name))
            lm = LocalLeapLM(model=model, mc_num=mc, mc_batch_size=batch, cfg=guide, seed=args.seed,
                             progress=not args.no_progress, stats_path=str(out / "cache" / f"{name}.stats.jsonl"))
            progress.models.append(lm)
            t0 = time.perf_counter()
            try:
                res = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=manager, num_fewshot=shots,
                                              limit=args.limit, use_cache=str(out / "cache" / name),
                                              bootstrap_iters=0, random_seed=args.seed)
            except CacheMismatchError as e:
                raise UserError(f"{e}; or pass another --output") from None
            except USER_ERRORS as e:
                raise UserError(str(e)) from None
            except KeyError as e:  # lm-eval: no such task
                raise UserError(f"lm-eval knows no task {name!r} ({e}); --tasks local runs offline") from None
            except (ConnectionError, OSError) as e:
                raise UserError(f"lm-eval could not load task {name} ({type(e).__name__}): offline? "
                                "--tasks local runs without the hub") from None
            seconds = time.perf_counter() - t0
            metrics = res["results"][name]
            n = res.get("n-samples", {}).get(name, {}).get("effective")
            summary["tasks"][name] = {"num_fewshot": shots, "cfg": guide, "mc_num": mc, "mc_batch_size": batch,
                                      "acc": metrics.get("acc,none"), "acc_norm": metrics.get("acc_norm,none"),
                                      "n": n, "seconds": seconds, "requests_scored": lm.rows_generated}
            write_atomically(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(f"\n{'task':24} {'shots':>5} {'cfg':>4} {'mc':>4} {'acc':>7} {'acc_norm':>8} {'n':>5} {'s':>7}")
    for name, r in summary["tasks"].items():
        fmt = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
        print(f"{name:24} {r['num_fewshot']:5d} {r['cfg']:4.1f} {r['mc_num']:4d} {fmt(r['acc']):>7} "
              f"{fmt(r['acc_norm']):>8} {r['n'] or '-':>5} {r['seconds']:7.1f}")
    print(f"\nwrote {out / 'summary.json'}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    progress = Progress(made="requests scored")  # what an interrupted run kept, for its one line
    return exit_status(lambda: evaluate(args, progress), progress)
