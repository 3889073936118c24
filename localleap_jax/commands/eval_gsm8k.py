"""GSM8K with lm-eval-harness's protocol, decoding strategies side by side.

    python experiments/eval_gsm8k.py                       # the embedded chain model, offline, ~7 min on 2 CPU cores
    python experiments/eval_gsm8k.py --model GSAI-ML/LLaDA-8B-Instruct          # GPU/TPU: converts once, then reuses
    python experiments/eval_gsm8k.py --checkpoint DIR --data test.jsonl --limit 200
    python experiments/eval_gsm8k.py --checkpoint ckpt/diffusion-gemma --limit 200   # DiffusionGemma: its canvas rules
    python experiments/eval_gsm8k.py --rules path/to/myrules.py --strategies steady:k=2,threshold   # your own rule

lm-eval provides the task (few-shot prompts, stop strings), the filters (`strict-match`,
`flexible-extract`) and the metric; `localleap_jax.lm_eval` only generates. Every
strategy runs on the same items. Results go to --output: samples.jsonl (one line per sample and
strategy), summary.json, and lm-eval's response cache, so rerunning with the same --output skips
what is done (also after an interruption mid-strategy). The cache is keyed on what the answers
depend on (the weights' content, the tokenizer, the data's content, every setting that changes
tokens, the code of each rule), so a changed model, setting or edited rule is generated again, never
read from an old run. One run holds --output at a time (OUT/.lock names it). The machinery is
`localleap_jax.gsm8k` (shared with sweep.py); this is its command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from localleap_jax import cli, processes
from localleap_jax.checkpoint import EMBEDDED_MODELS
from localleap_jax.cli import count, positive, probability, seed
from localleap_jax.decode import DecodeError
from localleap_jax.decode.cache import resolve as resolve_cache
from localleap_jax.dist.multihost import leading, mesh_for_run
from localleap_jax.gsm8k import (RULES_HELP, EvalSettings, Progress, UserError, check_gen_length, check_output,
                                 collect, config_record, default_output, default_strategies, exit_status,
                                 find_checkpoint, holding, load_model, load_user_rules, plan_data, read_model_config,
                                 rule_record, run_strategy, summarize, write_atomically, write_task)
from localleap_jax.lm_eval import follow
from localleap_jax.lm_eval.args import ModelArgsError, check_batching
from localleap_jax.partition import parse_mesh
from localleap_jax.rules import RULES, SHARED_SETTINGS, parse_spec, split_specs
from localleap_jax.rules.strategy import settings_taken

RUNS = Path("runs") / "eval_gsm8k"  # the default --output's parent, under the current directory
DEFAULT_BATCH_SIZE = 32
LLADA_HINT = ("To evaluate LLaDA-8B-Instruct (GPU/TPU, internet for the first run): "
              "python experiments/eval_gsm8k.py --model GSAI-ML/LLaDA-8B-Instruct --limit 200")


# ---------------------------------------------------------------- command line


def parse_args(argv=None):
    ap = cli.OneLineParser(prog="python experiments/eval_gsm8k.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="converted checkpoint directory, or embedded-chain (the default: tiny-chain, "
                     "where the rules score apart), embedded (tiny-math), embedded-sdar")
    src.add_argument("--model", help="hub id, e.g. GSAI-ML/LLaDA-8B-Instruct: converted once into "
                                     "~/.cache/localleap_jax/checkpoints and reused")
    ap.add_argument("--data", help="GSM8K-format JSONL (question, answer) to evaluate on (default: the embedded "
                                   "model's held-out synthetic split, or lm-eval's gsm8k from the hub)")
    ap.add_argument("--fewshot-data", help="JSONL to draw few-shot examples from (default: train.jsonl beside --data, "
                                           "else --data itself, never a problem's own example)")
    ap.add_argument("--strategies",
                    help="comma-separated rules, each a name with optional settings, e.g. "
                         "localleap,threshold:kappa=0.8,eb:gamma=0.01,klass:tau_c=0.6,tau_kl=0.015; the first is the "
                         "baseline of the ratios (default: the model family's, e.g. low_confidence,threshold,"
                         "localleap; for SDAR low_confidence,dynamic:threshold=0.9,threshold,localleap; for a "
                         "uniform-noise canvas model (DiffusionGemma) its canvas rules entropy_bound,localleap_uniform; "
                         "names: "
                         "low_confidence, threshold, localleap, factor, eb, margin, entropy, klass, stable, dynamic; "
                         "canvas rules entropy_bound, localleap_uniform; and those --rules registers; a masked rule "
                         "on a canvas model, or a canvas rule on a masked one, is refused)"),
    ap.add_argument("--rules", action="append", metavar="FILE.py|MODULE", help=RULES_HELP)
    ap.add_argument("--limit", type=positive, help="evaluate only the first N problems")
    ap.add_argument("--batch-size", type=positive, help="rows decoded at once (default 32; with --slots: --slots)")
    ap.add_argument("--slots", type=positive, help="continuous batching: rows the loop holds (default: --batch-size); "
                                                   "a finished row's slot takes the next prompt inside the loop")
    ap.add_argument("--queue", type=positive, help="prompts per compiled call through the slots (default 4 x "
                                                   "--slots; equal to --slots: fixed batches, as before slots; "
                                                   "below --slots: refused, it would leave slots idle)")
    ap.add_argument("--gen-length", type=positive, help="generation canvas (default 256; the embedded model's own: 64; "
                                                        "a uniform-noise canvas model: 256 rounded up to whole "
                                                        "canvases)")
    ap.add_argument("--block-length", type=positive,
                    help="block size (default 32; embedded model: 16; a block-diffusion model: its own block_size; a "
                         "uniform-noise canvas model (DiffusionGemma): its canvas_length)")
    ap.add_argument("--num-fewshot", type=count, help="few-shot examples (default 5; embedded model: 0)")
    ap.add_argument("--truncate-fewshot", action="store_true",
                    help="drop few-shot examples from the front of a prompt that is too long for the model (counted "
                         "in summary.json) instead of refusing the run")
    ap.add_argument("--steps", type=positive, help="steps of the rules on LLaDA's schedule (low_confidence, margin, "
                                                   "entropy, klass; default gen_length: one token per step)")
    ap.add_argument("--kappa", type=probability, help="anchor / threshold confidence of the rules that take it "
                                                      "(default: the rule's, 0.9); a rule's own setting wins")
    ap.add_argument("--tau", type=probability, help="relaxed threshold near an anchor (localleap; default 0.75)")
    ap.add_argument("--radius", type=count,
                    help="W, the anchor neighbourhood (localleap, localleap_uniform; default 4); --steps, --kappa, "
                         "--tau, --radius: refused when no strategy of the run takes it (e.g. --kappa with the canvas "
                         "rules)")
    ap.add_argument("--cache", default="auto",
                    help="cache policy: auto, none, prefix, dual, block, encoder, or the field's dllm_cache, dkv, "
                         "d2cache, vicinity, each with settings as name:setting=value,... (dkv:reload_every=4; a "
                         "user's policy from --rules) (default auto: the exact block cache for a block-diffusion "
                         "model, the encoder's K/V for a uniform-noise canvas model (its only cache), none otherwise); "
                         "a comma-separated list (dual,dllm_cache:gen_interval=4,dkv) runs each, names the rows "
                         "strategy+cache and reports the fraction of outputs identical to the first one's")
    ap.add_argument("--early-stop", action="store_true",
                    help="stop a row after a finished block that holds EOS (a masked model's; a canvas model's rows "
                         "always end on EOS)")
    ap.add_argument("--dtype", default="auto", choices=cli.DTYPES, help=cli.DTYPE_HELP)
    ap.add_argument("--output", help="output directory (default runs/eval_gsm8k/<model>-<8 hex of its weights' "
                    "fingerprint>-<8 hex of the settings that change the results: strategies, data, canvas, ...>, "
                    "under the current directory)")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent compilation cache")
    ap.add_argument("--seed", type=seed, default=0, help="seed of the draws: sampling, a uniform-noise canvas model's "
                                                         "noise (default 0)")
    dist = ap.add_argument_group("devices and processes", "every process of a multi-process run runs the same "
                                 "command (with its own --process-id); process 0 writes everything")
    dist.add_argument("--mesh", help="data=D,model=M: split the batch D ways and the weights M ways over all devices "
                                     "(an axis left out takes the rest); default: without --mesh one process "
                                     "replicates the weights on each local device (pmap), several processes use "
                                     "model=1")
    dist.add_argument("--coordinator", help="HOST:PORT of process 0, to join a multi-process run (or JAX_COORDINATOR_"
                                            "ADDRESS; 'auto': let JAX detect the cluster, e.g. a TPU pod or SLURM)")
    dist.add_argument("--num-processes", type=positive, help="processes in the run (or JAX_NUM_PROCESSES)")
    dist.add_argument("--process-id", type=count, help="this process's number, 0 to N-1 (or JAX_PROCESS_ID)")
    args = ap.parse_args(argv)
    args.strategies = None if args.strategies is None else split_specs(args.strategies)
    args.caches = split_specs(args.cache)
    for flag, given in (("--strategies", ["-"] if args.strategies is None else args.strategies),
                        ("--cache", args.caches)):
        if not given:
            ap.error(f"argument {flag}: no names given")
        twice = sorted({n for n in given if given.count(n) > 1})
        if twice:
            ap.error(f"argument {flag}: {', '.join(twice)} given twice")
    if args.slots is not None and args.batch_size is not None and args.slots != args.batch_size:
        ap.error(f"argument --slots: --slots {args.slots} and --batch-size {args.batch_size} both say how many rows the "
                 "loop holds; give one of them")
    args.batch_size = args.batch_size or args.slots or DEFAULT_BATCH_SIZE
    try:
        check_batching(args.batch_size, args.slots, args.queue, ("--batch-size", "--slots", "--queue"))
    except ModelArgsError as e:
        ap.error(f"argument --queue: {e}")
    if args.fewshot_data and not args.data:
        ap.error("argument --fewshot-data: needs --data (the default data brings its own few-shot examples)")
    if args.mesh is not None:
        try:
            parse_mesh(args.mesh)
        except DecodeError as e:
            ap.error(f"argument --{e}")
    return args


# ---------------------------------------------------------------- running


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        mesh = join_processes(args)  # first thing: nothing may touch a JAX backend before the processes are joined
    except UserError as e:
        print(f"error: {cli.one_line(e)}", file=sys.stderr)
        return cli.EXIT_ERROR
    if processes.is_follower():
        return follow(compile_cache=not args.no_compile_cache)  # runs the leader's generations; writes nothing
    progress = Progress()
    try:
        return exit_status(lambda: lead(args, mesh, progress), progress)
    except processes.LostProcessError as e:
        progress.flush()
        processes.exit_lost(f"{e}; {progress.kept()}")


def join_processes(args):
    """Join the other processes (--coordinator ...; nothing for one process), then the --mesh over every
    device of every process (None: the single-process pmap path)."""
    try:
        processes.initialize(processes.processes_from(args.coordinator, args.num_processes, args.process_id))
    except processes.DistributedError as e:
        raise UserError(str(e)) from None
    try:
        return mesh_for_run(args.mesh)
    except DecodeError as e:
        raise UserError(f"--{e}") from None


def lead(args, mesh, progress: Progress) -> int:
    """The run, on process 0 (or the only process)."""
    with leading():  # the followers are released however this ends
        return run(args, mesh, progress)


def run(args, mesh, progress: Progress) -> int:
    # Everything that can be checked cheaply is checked before anything is created or loaded.
    if args.output:
        check_output(Path(args.output).expanduser().resolve())
    load_user_rules(args.rules)  # process 0 only: a follower loads what each generation's message names
    check_caches(args.caches)  # after --rules: a user's file may register policies
    path, manifest = find_checkpoint(args.model or args.checkpoint or cli.DEFAULT_CHECKPOINT)
    config = read_model_config(path)
    args.strategies = args.strategies or split_specs(default_strategies(config, manifest))
    settings = EvalSettings.for_model(
        manifest, model=config, gen_length=args.gen_length, block_length=args.block_length, num_fewshot=args.num_fewshot,
        batch_size=args.batch_size, slots=args.slots, queue=args.queue, limit=args.limit, seed=args.seed, truncate_fewshot=args.truncate_fewshot,
        early_stop=args.early_stop, cache=args.caches[0], steps=args.steps, kappa=args.kappa, tau=args.tau,
        radius=args.radius, compile_cache=not args.no_compile_cache, mesh=mesh)
    if not config.block_causal and settings.gen_length % settings.block_length:
        whole = ("the model decodes whole canvases of its canvas_length" if config.canvas_length else
                 "the canvas is cut into whole blocks")
        raise UserError(f"--gen-length {settings.gen_length} is not a multiple of --block-length {settings.block_length}"
                        f" ({whole})")
    check_shared_flags(args.strategies, settings)
    for cache_mode in args.caches:  # every strategy with every cache of the list, before any work
        check_strategies(args.strategies, dataclasses.replace(settings, cache=cache_mode),
                         f" with --cache {cache_mode}" if len(args.caches) > 1 else "")
    check_gen_length(settings.gen_length, path)
    plan = plan_data(args.data, args.fewshot_data, settings.num_fewshot, manifest)
    # The default --output is the model's and this run's: runs that would give other results (other strategies,
    # data, canvas, ...) never replace each other's summary.
    out = Path(args.output or default_output(RUNS, path, manifest, run=results_identity(args, settings, plan)))
    out = out.expanduser().resolve()
    check_output(out)

    with holding(out, progress):  # held from here on, so a second run is refused before it loads anything
        model = load_model(path, args.dtype, mesh)
        task = write_task(plan, out)
        print(f"model {path} ({model.config.num_params / 1e6:.1f}M params, {model.dtype}); data: {plan.description}; "
              f"{settings.num_fewshot}-shot, gen {settings.gen_length}, block {settings.block_length}, "
              f"cache {args.cache}; output {out}")
        summary, samples = evaluate_all(model, args.strategies, args.caches, settings, task, out, progress)
        write_results(out, summary, samples, config_record(settings, args.cache, path, model, plan, task))
    print_table(summary)
    print(f"\nwrote {out / 'samples.jsonl'} and {out / 'summary.json'}")
    if path.resolve() in {p.resolve() for p in EMBEDDED_MODELS.values()}:
        print(LLADA_HINT)
    return 0


def check_caches(caches: list[str]) -> None:
    """Every --cache entry names a policy with settings it has (one line otherwise)."""
    for spec in caches:
        try:
            resolve_cache(spec)
        except DecodeError as e:
            hint = "; a policy of your own: --rules path/to/mypolicy.py" if "unknown cache" in str(e) else ""
            raise UserError(f"--cache {spec}: {e}{hint}") from None


def results_identity(args, settings: EvalSettings, plan) -> dict:
    """What the results of a run depend on besides the weights (the default --output is named by its digest): not
    where it runs or how its batches are laid out (those change speed, not answers)."""
    return {"strategies": args.strategies, "caches": args.caches, "data": plan.description,
            "fewshot": str(plan.fewshot) if plan.fewshot else None, "dtype": args.dtype,
            **{k: getattr(settings, k) for k in ("gen_length", "block_length", "num_fewshot", "limit", "seed",
                                                "truncate_fewshot", "early_stop", "steps", "kappa", "tau", "radius")}}


def check_strategies(strategies: list[str], settings: EvalSettings, where: str = "") -> None:
    """Every --strategies entry with the decoding flags, checked together before anything is loaded."""
    for strategy in strategies:
        try:
            settings.check(strategy)
        except DecodeError as e:
            hint = "; a rule of your own: --rules path/to/myrules.py" if str(e).startswith("unknown strategy") else ""
            raise UserError(f"--strategies {strategy}{where}: {e}{hint}") from None


def check_shared_flags(strategies: list[str], settings: EvalSettings) -> None:
    """A shared flag (--kappa, --tau, --radius, --steps) that no strategy of the run takes would change nothing:
    refused in one line (e.g. --kappa with the canvas rules of a DiffusionGemma checkpoint)."""
    rules_named = [parse_spec(s)[0] for s in strategies]
    for flag in SHARED_SETTINGS:
        value = getattr(settings, flag)
        if value is not None and not any(flag in settings_taken(n) for n in rules_named if n in RULES):
            takers = sorted(n for n in RULES if flag in settings_taken(n))
            raise UserError(f"--{flag} {value}: none of the strategies ({', '.join(rules_named)}) takes {flag}, so it would "
                            f"change nothing; the rules that do: {', '.join(takers)}")


def evaluate_all(model, strategies, caches, settings, task, out, progress) -> tuple[dict, list[dict]]:
    summary, all_rows, texts = {}, [], {}
    for cache_mode in caches:
        for strategy in strategies:
            name = strategy if len(caches) == 1 else f"{strategy}+{cache_mode}"
            t0 = time.time()
            lm, samples, batches = run_strategy(model, strategy, dataclasses.replace(settings, cache=cache_mode),
                                                task, out, progress)
            rows = collect(name, lm, samples)
            all_rows += rows
            summary[name] = {**summarize(rows), **rule_record(lm.cfg)}  # the rule's full spec and code digest
            texts[strategy, cache_mode] = [r["generated"] for r in rows]
            if cache_mode != caches[0]:  # how often the cached approximation changed nothing
                same = [a == b for a, b in zip(texts[strategy, cache_mode], texts[strategy, caches[0]])]
                summary[name][f"identical_to_{caches[0]}"] = sum(same) / len(same)
            truncated = f", {summary[name]['truncated']} prompts lost few-shot examples" if summary[name]["truncated"] else ""
            print(f"{name}: {summary[name]['accuracy_strict']:.3f} strict, mean NFE "
                  f"{summary[name]['mean_nfe']:.1f} ({batches} batches generated, {time.time() - t0:.0f}s{truncated})")
    first = next(iter(summary.values()))
    for s in summary.values():
        s["nfe_ratio"] = s["mean_nfe"] / max(first["mean_nfe"], 1e-9)
        s["speedup"] = first["seconds_per_sample"] / max(s["seconds_per_sample"], 1e-9)
    return summary, all_rows


def print_table(summary: dict) -> None:
    names_ = list(summary)
    same_key = next((k for s in summary.values() for k in s if k.startswith("identical_to_")), None)
    indel = any(s.get("mean_inserts") or s.get("mean_deletes") for s in summary.values())  # insert/delete columns
    bound = any(s.get("hit_bound") for s in summary.values())  # rows stopped by max_passes with masks left
    elsewhere = [n for n in names_ if summary[n].get("timed_elsewhere")]
    width = max(16, max(map(len, names_)) + 3)
    print(f"\n{'strategy':<{width}}{'strict':>8}{'flexible':>10}{'mean NFE':>10}{'remasks':>9}{'edits':>8}"
          + (f"{'inserts':>9}{'deletes':>9}" if indel else "")
          + f"{'NFE ratio':>11}"
          f"{'speedup':>9}"
          f"{'tok/s':>9}{'s/sample':>10}{'compile s':>11}{'passes':>8}{'occupied':>9}{'n':>6}"
          + (f"{'bound':>7}" if bound else "") + (f"{'same':>7}" if same_key else ""))
    for name in names_:
        s = summary[name]
        same = f"{s[same_key]:>7.2f}" if same_key and same_key in s else ("      -" if same_key else "")
        label = f"{name} *" if name in elsewhere else name
        print(f"{label:<{width}}{s['accuracy_strict']:>8.3f}{s['accuracy_flexible']:>10.3f}{s['mean_nfe']:>10.1f}"
              f"{s.get('mean_remasks', 0.0):>9.2f}{s.get('mean_edits', 0.0):>8.2f}"
              + (f"{s.get('mean_inserts', 0.0):>9.2f}{s.get('mean_deletes', 0.0):>9.2f}" if indel else "")
              + f"{s['nfe_ratio']:>11.3f}{s['speedup']:>8.2f}x{s['tokens_per_second']:>9.1f}"
              f"{s['seconds_per_sample']:>10.4f}{s['compile_seconds']:>11.1f}"
              + (f"{s['passes']:>8.0f}{s['occupancy']:>9.2f}" if s.get("passes") is not None else f"{'-':>8}{'-':>9}")
              + f"{s['n']:>6}" + (f"{s.get('hit_bound', 0):>7}" if bound else "") + same)
    if bound:
        print("bound: answers stopped by the pass bound (max_passes) with masks left (summary.json: hit_bound; "
              "samples.jsonl: each row's)")
    for name in elsewhere:
        s = summary[name]
        settings = "; ".join(", ".join(f"{k} {v}" for k, v in b.items() if v is not None) if b else "not recorded"
                             for b in s["timed_with"])
        print(f"* {name}: {s['timed_elsewhere']} of {s['n']} answers come from an earlier run's cache, generated with "
              f"other batch settings ({settings}): their speed (speedup, tok/s, s/sample, passes, occupied) is that "
              "run's, not comparable with this one's; another --output times them again")


def write_results(out: Path, summary: dict, rows: list[dict], config: dict) -> None:
    write_atomically(out / "samples.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    write_atomically(out / "summary.json", json.dumps({"strategies": summary, "config": config}, indent=2))

