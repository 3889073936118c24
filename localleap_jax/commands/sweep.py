"""Hyperparameter sweeps of the decoding rules: the paper's Figure 4 and an accuracy/speed Pareto plot.

    python experiments/sweep.py --output runs/sweep                 # embedded chain model, offline, ~5 min, 2 cores
    python experiments/sweep.py --strategies threshold,localleap --output runs/sweep
    python experiments/sweep.py --grid "localleap:kappa=0.8;0.9,tau=0.6;0.75,radius=2;4" --output runs/sweep
    python experiments/sweep.py --rules path/to/myrules.py --strategies steady,threshold --grid "steady:k=1;2;3" \
        --skip-figure4 --output runs/sweep-mine                       # your own rule beside the built-in ones
    python experiments/sweep.py --model GSAI-ML/LLaDA-8B-Instruct --data test.jsonl --limit 500 --grids large \\
        --output runs/sweep-llada                                     # GPU/TPU

Every point is one rule with one setting per axis of its grid ("threshold:kappa=0.7"), scored on GSM8K
by lm-eval exactly as `eval_gsm8k.py --strategies <that point>` scores it (the same functions, from
`localleap_jax.gsm8k`: the same prompts, batches, filters, metric and resume cache), so its answers are
the ones eval_gsm8k gives.
Each point runs in batches of its own, so its tokens/s is its own (a batch holding several settings
would share one wall time among them); the settings are traced, so a rule's whole grid runs on the
programs its first point compiled (one per batch shape and prompt bucket; sweep.json counts them).

Outputs in --output:
  figure4.png   univariate ablations of LocalLeap's kappa, W (radius) and tau around (0.9, 4, 0.75):
                accuracy, tokens/s and mean NFE against the value; dashed: LLaDA's low_confidence with one
                token per step (the 1-token baseline)
  pareto.png    accuracy against mean NFE and against tokens/s for every strategy's grid, each
                strategy's Pareto frontier drawn
  sweep.json    "points" (every point's eval_gsm8k summary, by spec), "pareto" (each rule's points and
                frontiers), "figure4" (the series and the baseline), "comparison" (the answer to "is
                LocalLeap's frontier above threshold's on this model", see `compare_frontiers`), "compiles"
                (programs this run compiled per rule, their [batch, prompt] shapes, per point: a rerun
                from the caches compiles none), "batches_generated", "config"
  samples.jsonl one line per problem and point (eval_gsm8k's format; "strategy" is the point's spec)
  cache/        lm-eval's response caches: a rerun generates nothing, an interrupted sweep resumes

Grids: `--grids small` (default: a few points per rule, minutes on CPU) or `large` (a rule with no preset grid,
such as one of --rules', runs at its defaults); `--grid
NAME:setting=v1;v2,setting=v3` replaces NAME's grid by the product of the values given (a setting not
named keeps the rule's default; a combination the rule refuses, such as localleap with tau > kappa, is
left out). `--ablation kappa=0.8;0.9` replaces Figure 4's values of one setting, `--center` its centre.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from localleap_jax import cli
from localleap_jax.cli import count, positive, seed
from localleap_jax.compile_cache import compiled_programs
from localleap_jax.decode import DecodeError
from localleap_jax.gsm8k import (RULES_HELP, EvalSettings, Progress, UserError, check_gen_length, check_output,
                                 collect, config_record, exit_status, find_checkpoint, holding, load_model,
                                 load_user_rules, plan_data, read_model_config, rule_record, run_strategy, summarize,
                                 write_atomically, write_task)
from localleap_jax.rules import RULES
from localleap_jax.rules.registry import unknown_rule

# The rules a sweep runs when --strategies names none; any registered rule may be named (--rules adds a user's).
RULE_NAMES = ("low_confidence", "threshold", "localleap", "factor", "eb", "margin", "entropy", "klass", "stable")


@dataclasses.dataclass(frozen=True)
class PerStep:
    """A preset's value of `steps` as tokens per step, so one preset fits every canvas: steps =
    gen_length / tokens (1 token per step: steps None, LLaDA's own setting)."""

    tokens: int

    def steps(self, gen_length: int, block_length: int) -> int | None:
        if block_length % self.tokens:
            return NotImplemented  # LLaDA's schedule cannot spread a block over these steps
        return None if self.tokens == 1 else gen_length // self.tokens



# Each rule's grid: setting -> values, swept as their product. "small" runs in minutes on the embedded
# model on a 2-core CPU (each point costs about its mean NFE x --limit rows of forward passes); "large"
# is for an accelerator and a real model. Schedules are given in tokens per step (PerStep).
GRIDS = {
    "small": {
        "low_confidence": {"steps": [PerStep(16), PerStep(1)]},
        "threshold": {"kappa": [0.5, 0.7, 0.9]},
        "localleap": {"kappa": [0.7, 0.9], "tau": [0.5, 0.75], "radius": [2, 4]},
        "factor": {"f": [1.0, 4.0]},
        "eb": {"gamma": [0.01, 1.0]},
        "margin": {"steps": [PerStep(16)]},
        "entropy": {"steps": [PerStep(16)]},
        "klass": {"tau_c": [0.9], "tau_kl": [0.01]},
        "stable": {"k": [2], "c_min": [0.5]},
        "credit": {"threshold": [0.7, 0.9]},
        "hierarchy": {"low_threshold": [0.3, 0.5]},
        "smooth": {"threshold": [0.7, 0.9]},
    },
    "large": {
        "low_confidence": {"steps": [PerStep(16), PerStep(8), PerStep(4), PerStep(2), PerStep(1)]},
        "threshold": {"kappa": [0.3, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95]},
        "localleap": {"kappa": [0.7, 0.8, 0.9, 0.95], "tau": [0.5, 0.6, 0.7, 0.75, 0.8], "radius": [1, 2, 4, 8]},
        "factor": {"f": [0.25, 0.5, 1.0, 2.0, 4.0]},
        "eb": {"gamma": [0.001, 0.01, 0.1, 0.5, 1.0]},
        "margin": {"steps": [PerStep(16), PerStep(8), PerStep(4), PerStep(2)]},
        "entropy": {"steps": [PerStep(16), PerStep(8), PerStep(4), PerStep(2)]},
        "klass": {"tau_c": [0.6, 0.8, 0.9], "tau_kl": [0.001, 0.01, 0.05]},
        "stable": {"k": [1, 2, 3], "c_min": [0.3, 0.5, 0.7]},
        # dInfer's: its scripts' thresholds, the credit weight halved and doubled, the authors' hierarchy pairs
        "credit": {"threshold": [0.7, 0.8, 0.9, 0.95], "credit_alpha": [0.35, 0.7, 1.4]},
        "hierarchy": {"threshold": [None, 0.8, 0.9, 0.92], "low_threshold": [0.3, 0.4, 0.5, 0.62, 0.75]},
        "smooth": {"threshold": [0.7, 0.8, 0.9, 0.95], "cont_weight": [0.15, 0.3]},
    },
}
# Figure 4: LocalLeap's centre (the paper's defaults) and the values each ablation visits.
CENTER = {"kappa": 0.9, "radius": 4, "tau": 0.75}
ABLATIONS = {
    "small": {"kappa": [0.8, 0.9, 0.95], "radius": [0, 4, 8], "tau": [0.5, 0.75, 0.9]},
    "large": {"kappa": [0.75, 0.8, 0.85, 0.9, 0.95, 0.99], "radius": [0, 1, 2, 4, 8, 16],
              "tau": [0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9]},
}
BASELINE = "low_confidence"  # steps None: one token per step, LLaDA's own setting
AXES = {"mean_nfe": 1.0, "tokens_per_second": -1.0}  # cost = sign x value: lower mean NFE, higher tokens/s is better
METRIC = "accuracy_strict"  # what the frontiers and Figure 4 plot (lm-eval's strict-match, eval_gsm8k's headline)


# ---------------------------------------------------------------- command line


def parse_args(argv=None):
    ap = cli.OneLineParser(prog="python experiments/sweep.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="converted checkpoint directory, or embedded-chain (the default: tiny-chain, "
                     "where the rules score apart), embedded (tiny-math), embedded-sdar")
    src.add_argument("--model", help="hub id, converted once and reused (as eval_gsm8k.py --model)")
    ap.add_argument("--data", help="GSM8K-format JSONL (default: the embedded model's held-out synthetic split)")
    ap.add_argument("--fewshot-data", help="JSONL to draw few-shot examples from (as eval_gsm8k.py)")
    ap.add_argument("--limit", type=positive, default=100, help="problems per point (default %(default)s)")
    ap.add_argument("--batch-size", type=positive, default=50,
                    help="rows per batch (default %(default)s: --limit 100 is two full batches, one program per "
                         "rule and prompt bucket)")
    ap.add_argument("--gen-length", type=positive, help="generation canvas (default 256; embedded model: 64)")
    ap.add_argument("--block-length", type=positive, help="block size (default 32; embedded model: 16)")
    ap.add_argument("--num-fewshot", type=count, help="few-shot examples (default 5; embedded model: 0)")
    ap.add_argument("--truncate-fewshot", action="store_true", help="as eval_gsm8k.py")
    ap.add_argument("--cache", default="auto",
                    help="cache policy, a name or name:setting=value,... as eval_gsm8k.py's (default %(default)s: the "
                         "exact block cache for a block-diffusion model, else none)")
    ap.add_argument("--early-stop", action="store_true", help="stop a row after a finished block that holds EOS")
    ap.add_argument("--dtype", default="auto", choices=cli.DTYPES, help=cli.DTYPE_HELP)
    ap.add_argument("--seed", type=seed, default=0)
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent compilation cache")
    ap.add_argument("--strategies", default=",".join(RULE_NAMES),
                    help="comma-separated rule names whose grids make the Pareto plot (default: %(default)s; any "
                         "other registered rule, --rules' included, may be named)")
    ap.add_argument("--rules", action="append", metavar="FILE.py|MODULE", help=RULES_HELP)
    ap.add_argument("--grids", default="small", choices=tuple(GRIDS), help="preset grids (default %(default)s)")
    ap.add_argument("--grid", action="append", default=[], metavar="NAME:SETTING=V1;V2,...",
                    help="replace NAME's grid by the product of these values (repeatable)")
    ap.add_argument("--ablation", action="append", default=[], metavar="SETTING=V1;V2;...",
                    help="Figure 4: the values of kappa, radius or tau (repeatable)")
    ap.add_argument("--center", metavar="kappa=K,radius=W,tau=T",
                    help="Figure 4's centre (default kappa=0.9,radius=4,tau=0.75)")
    ap.add_argument("--skip-figure4", action="store_true", help="only the Pareto plot")
    ap.add_argument("--output", required=True, help="output directory (a rerun resumes from it)")
    args = ap.parse_args(argv)
    try:
        load_user_rules(args.rules)
        args.strategies = parse_strategies(args.strategies)
        args.grid = dict(parse_grid(text) for text in args.grid)
        args.ablation = dict(parse_ablation(text) for text in args.ablation)
        args.center = {**CENTER, **(parse_center(args.center) if args.center else {})}
    except UserError as e:
        ap.error(str(e))
    for name in args.grid:
        if name not in args.strategies:
            ap.error(f"argument --grid: {name} is not among --strategies ({', '.join(args.strategies)})")
    if args.fewshot_data and not args.data:
        ap.error("argument --fewshot-data: needs --data")
    return args


def eval_settings_of(args, manifest: dict, model=None) -> EvalSettings:
    """What every point is scored with: these flags, the model's defaults for the canvas, no rule setting
    (a point's settings travel in its spec, never in --kappa & co), one process with a model copy per local
    device (no --mesh here)."""
    return EvalSettings.for_model(
        manifest, gen_length=args.gen_length, block_length=args.block_length, num_fewshot=args.num_fewshot,
        batch_size=args.batch_size, limit=args.limit, seed=args.seed, truncate_fewshot=args.truncate_fewshot,
        early_stop=args.early_stop, cache=args.cache, compile_cache=not args.no_compile_cache, model=model)


def parse_strategies(text: str) -> list[str]:
    given = [t.strip() for t in text.split(",") if t.strip()]
    if not given:
        raise UserError("argument --strategies: no names given")
    for name in given:
        if ":" in name or "=" in name:
            raise UserError(f"argument --strategies: {name!r}: give rule names here; sweep a setting with "
                            f"--grid {name.split(':')[0]}:setting=v1;v2")
        if name not in RULES:
            raise UserError(f"argument --strategies: {unknown_rule(name, 'rule')} "
                            "(a rule of your own: --rules path/to/myrules.py)")
    twice = sorted({n for n in given if given.count(n) > 1})
    if twice:
        raise UserError(f"argument --strategies: {', '.join(twice)} given twice")
    return given


def parse_values(flag: str, key: str, text: str) -> list:
    from localleap_jax.rules.registry import parse_value

    values = []
    for piece in text.split(";"):
        if not piece.strip():
            raise UserError(f"argument {flag}: {key}={text!r} has an empty value")
        try:
            values.append(parse_value(piece))
        except DecodeError:
            raise UserError(f"argument {flag}: {key}={text!r}: {piece.strip()!r} is not a number (or none)") from None
        if isinstance(values[-1], list):
            raise UserError(f"argument {flag}: {key}={text!r}: separate values with ';', without brackets")
    if len(set(map(repr, values))) < len(values):
        raise UserError(f"argument {flag}: {key}={text!r} names a value twice")
    return values


def parse_assignments(flag: str, text: str) -> dict[str, list]:
    """'a=1;2,b=3' -> {'a': [1, 2], 'b': [3]}."""
    out: dict[str, list] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, values = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UserError(f"argument {flag}: {item!r} is not setting=value;value;...")
        if key in out:
            raise UserError(f"argument {flag}: {key} given twice")
        out[key] = parse_values(flag, key, values)
    if not out:
        raise UserError(f"argument {flag}: {text!r} names no setting")
    return out


def rule_settings(name: str) -> list[str]:
    from localleap_jax.rules.base import settings_of

    return sorted(settings_of(RULES[name]()))


def parse_grid(text: str) -> tuple[str, dict[str, list]]:
    """'localleap:kappa=0.8;0.9,tau=0.7' -> ('localleap', {'kappa': [0.8, 0.9], 'tau': [0.7]})."""
    name, colon, rest = text.strip().partition(":")
    name = name.strip()
    if not colon:
        raise UserError(f"argument --grid: {text!r} is not NAME:setting=v1;v2,...")
    if name not in RULES:
        raise UserError(f"argument --grid: {unknown_rule(name, 'rule')}")
    axes = parse_assignments("--grid", rest)
    unknown = sorted(set(axes) - set(rule_settings(name)))
    if unknown:
        raise UserError(f"argument --grid: {name} has no setting {', '.join(unknown)}; its settings: "
                        f"{', '.join(rule_settings(name))}")
    return name, axes


def parse_ablation(text: str) -> tuple[str, list]:
    axes = parse_assignments("--ablation", text)
    if len(axes) != 1:
        raise UserError(f"argument --ablation: {text!r}: one setting per --ablation")
    (key, values), = axes.items()
    if key not in CENTER:
        raise UserError(f"argument --ablation: {key!r}: Figure 4 ablates kappa, radius or tau")
    return key, values


def parse_center(text: str) -> dict:
    axes = parse_assignments("--center", text)
    bad = sorted(set(axes) - set(CENTER))
    if bad:
        raise UserError(f"argument --center: {', '.join(bad)}: the centre has kappa, radius and tau")
    if any(len(v) != 1 for v in axes.values()):
        raise UserError(f"argument --center: {text!r}: one value per setting")
    return {k: v[0] for k, v in axes.items()}


# ---------------------------------------------------------------- grids -> points


def point_spec(name: str, settings: dict) -> str:
    """The canonical spec of one point ('threshold:kappa=0.7'): every setting, sorted, as eval_gsm8k takes it."""
    import localleap_jax as ll

    return ll.rule(name, **settings).spec()


def check_point(name: str, settings: dict, eval_settings: EvalSettings) -> tuple[str | None, str | None]:
    """(spec, None) for a point eval_gsm8k would run, else (None, why it refuses it)."""
    import localleap_jax as ll

    try:
        # The rule object first (ll.rule checks its settings, None included: a spec would leave a None setting out
        # and read back as the default); then the canvas as eval_gsm8k checks it, with the model (a block-diffusion
        # model's grid takes any gen_length, and `steps` against its blocks per row).
        spec = ll.rule(name, **settings).spec()
        eval_settings.check(spec)  # what eval_gsm8k checks
    except DecodeError as e:
        return None, str(e)
    return spec, None


def grid_points(name: str, axes: dict[str, list], eval_settings: EvalSettings) -> list[str]:
    """The specs of every combination of `axes` the rule accepts, in product order.

    A combination the rule refuses (localleap with tau > kappa) is left out; a value refused in every
    combination it appears in (kappa=1.5, steps that do not divide into the blocks) is a mistake."""
    keys = list(axes)
    kept, refused = [], {}
    for combo in itertools.product(*(axes[k] for k in keys)):
        spec, why = check_point(name, dict(zip(keys, combo)), eval_settings)
        if why is None:
            kept.append(spec)
        else:
            refused[combo] = why
    for i, key in enumerate(keys):
        for value in axes[key]:
            reasons = [why for combo, why in refused.items() if combo[i] == value]
            if reasons and len(reasons) == math.prod(len(axes[k]) for k in keys if k != key):
                raise UserError(f"--grid {name}:{key}={value}: {reasons[0]}")
    if refused:
        print(f"note: {name}: left out {len(refused)} of {len(refused) + len(kept)} combinations the rule refuses "
              f"(e.g. {next(iter(refused.values()))})", file=sys.stderr)
    return list(dict.fromkeys(kept))


def figure4_points(args, eval_settings: EvalSettings) -> dict[str, list[tuple[float, str]]]:
    """Figure 4's series: setting -> [(value, spec)], the other two settings at the centre."""
    _, why = check_point("localleap", args.center, eval_settings)
    if why:
        raise UserError(f"--center: {why}")
    series = {}
    for key, values in {**ABLATIONS[args.grids], **args.ablation}.items():
        series[key] = []
        for value in values:
            spec, why = check_point("localleap", {**args.center, key: value}, eval_settings)
            if why:
                raise UserError(f"--ablation {key}={value}: {why}")
            series[key].append((value, spec))
    return series


def preset_grid(name: str, preset: str, eval_settings: EvalSettings) -> dict[str, list]:
    """A preset grid ("small", "large") on this canvas: tokens-per-step values become steps (those the
    blocks cannot take are left out)."""
    grid = {}
    for key, values in GRIDS[preset].get(name, {}).items():  # no preset (a user's rule): one point, its defaults
        values = [v.steps(eval_settings.gen_length, eval_settings.block_length) if isinstance(v, PerStep) else v
                  for v in values]
        grid[key] = list(dict.fromkeys(v for v in values if v is not NotImplemented))
    return grid


def check_canvas(eval_settings: EvalSettings) -> None:
    """The flags every point shares (gen/block length, cache), checked once so a mistake there is not
    reported as one of a grid's values."""
    try:
        eval_settings.check(BASELINE)
    except DecodeError as e:
        raise UserError(str(e)) from None


def plan_points(args, eval_settings: EvalSettings) -> tuple[dict[str, dict[str, list]], dict[str, list[str]],
                                                            dict[str, list[tuple[float, str]]] | None]:
    """({rule: the grid swept}, {rule: its Pareto points}, Figure 4's series or None), everything checked
    before any work."""
    check_canvas(eval_settings)
    grids = {name: args.grid.get(name) or preset_grid(name, args.grids, eval_settings) for name in args.strategies}
    pareto = {name: grid_points(name, axes, eval_settings) for name, axes in grids.items()}
    return grids, pareto, None if args.skip_figure4 else figure4_points(args, eval_settings)


def run_order(pareto: dict[str, list[str]], figure4: dict | None) -> dict[str, list[str]]:
    """Every point to score, grouped by rule (a rule's points share its compiled programs), each once."""
    groups = {name: list(specs) for name, specs in pareto.items()}
    if figure4 is not None:
        groups.setdefault("localleap", []).extend(spec for series in figure4.values() for _, spec in series)
        groups.setdefault("low_confidence", []).append(point_spec(BASELINE, {}))
    return {name: list(dict.fromkeys(specs)) for name, specs in groups.items()}


# ---------------------------------------------------------------- frontiers


@dataclasses.dataclass(frozen=True)
class Point:
    spec: str
    accuracy: float
    cost: float  # lower is better: mean NFE, or minus tokens/s


def frontier(points: list[Point]) -> list[Point]:
    """The Pareto frontier, cheapest first: each point is more accurate than every point that costs as
    little or less (so no other point is at least as cheap and at least as accurate, one of them strictly)."""
    out, best = [], -math.inf
    for p in sorted(points, key=lambda p: (p.cost, -p.accuracy)):
        if p.accuracy > best:
            out.append(p)
            best = p.accuracy
    return out


def best_within(points: list[Point], cost: float) -> float:
    """The frontier as a step function: the best accuracy among points costing at most `cost` (nan if none)."""
    return max((p.accuracy for p in points if p.cost <= cost), default=math.nan)


def compare_frontiers(a: list[Point], b: list[Point], n: int) -> dict:
    """Is a's frontier above b's? Both as step functions F(c) = best accuracy at cost <= c, compared over
    the cost range both cover, [max of the cheapest points, min of the dearest points]; when those do not
    overlap, at the one cost where both first exist (the larger of the cheapest points: there one
    strategy's best meets the other's cheapest), and `overlap` is False.

    verdict: "above" (F_a >= F_b everywhere there and > somewhere), "below", "equal" or "crossing". The
    step functions change only at points' costs, so comparing at each of those inside the range (and at
    its ends) compares them everywhere. `mean_diff` is the length-weighted mean of F_a - F_b over the
    range. `two_se`: twice the standard error of a difference of two accuracies on n problems at the
    frontiers' mean accuracy, for telling a gap from noise (`within_noise`: every gap is smaller)."""
    lo = max(min(p.cost for p in a), min(p.cost for p in b))
    hi = min(max(p.cost for p in a), max(p.cost for p in b))
    overlap = lo <= hi
    hi = max(hi, lo)
    accs = [p.accuracy for p in frontier(a) + frontier(b)]
    mean_acc = sum(accs) / len(accs)
    two_se = 2 * math.sqrt(2 * mean_acc * (1 - mean_acc) / n)
    costs = sorted({lo, hi, *(p.cost for p in a + b if lo <= p.cost <= hi)})
    at = [(c, best_within(a, c), best_within(b, c)) for c in costs]
    diffs = [fa - fb for _, fa, fb in at]
    if hi > lo:  # each difference holds from its cost to the next
        mean_diff = sum(d * (c1 - c0) for d, (c0, c1) in zip(diffs, zip(costs, costs[1:]))) / (hi - lo)
    else:
        mean_diff = diffs[0]
    tol = 1e-12  # accuracies are fractions of n: equal ones are equal floats
    if all(abs(d) <= tol for d in diffs):
        verdict = "equal"
    elif min(diffs) >= -tol:
        verdict = "above"
    elif max(diffs) <= tol:
        verdict = "below"
    else:
        verdict = "crossing"
    return {"verdict": verdict, "range": [lo, hi], "overlap": overlap, "max_diff": max(diffs),
            "min_diff": min(diffs), "mean_diff": mean_diff, "two_se": two_se,
            "within_noise": max(abs(d) for d in diffs) < two_se, "at": [list(t) for t in at]}


def points_on(axis: str, results: dict[str, dict], specs: list[str]) -> list[Point]:
    return [Point(s, results[s][METRIC], AXES[axis] * results[s][axis]) for s in specs]


def pareto_record(results: dict[str, dict], pareto: dict[str, list[str]]) -> dict:
    """Per rule: its points and its frontier on each axis (specs, cheapest first)."""
    return {name: {"points": specs, **{f"frontier_{axis}": [p.spec for p in frontier(points_on(axis, results, specs))]
                                       for axis in AXES}}
            for name, specs in pareto.items()}


def answer(results: dict[str, dict], pareto: dict[str, list[str]], n: int) -> dict:
    """LocalLeap's frontier against threshold's, on each axis, with the sentence that answers the question."""
    if not {"localleap", "threshold"} <= set(pareto):
        return {"question": QUESTION, "answer": "not asked: needs localleap and threshold in --strategies"}
    out = {"question": QUESTION}
    for axis, sign in AXES.items():
        c = compare_frontiers(points_on(axis, results, pareto["localleap"]),
                              points_on(axis, results, pareto["threshold"]), n)
        c["range"] = sorted(sign * x for x in c["range"])  # back in the axis' own units
        c["at"] = [[sign * cost, fa, fb] for cost, fa, fb in c["at"]]
        out[axis] = c
    out["answer"] = sentence(out["mean_nfe"], "mean NFE")
    return out


QUESTION = ("Is LocalLeap's frontier above threshold's on this model? (for each mean NFE, the best accuracy at or "
            "below that NFE, compared over the NFE range both cover)")


def sentence(c: dict, what: str) -> str:
    lo, hi = c["range"]
    where = f"over {what} {lo:.2f}-{hi:.2f}" if c["overlap"] else \
        f"at {what} {lo:.2f} (their {what} ranges do not overlap; compared where both first exist)"
    gap = (f"differences from {100 * c['min_diff']:+.1f} to {100 * c['max_diff']:+.1f} points, mean "
           f"{100 * c['mean_diff']:+.1f}")
    noise = (f"within noise (2 standard errors of a difference at this n: {100 * c['two_se']:.1f} points)"
             if c["within_noise"] else f"larger than 2 standard errors ({100 * c['two_se']:.1f} points)")
    head = {"above": "yes: above or level everywhere", "below": "no: below or level everywhere",
            "equal": "level: equal everywhere", "crossing": "no: the frontiers cross"}[c["verdict"]]
    return f"{head} {where} ({gap}); {noise}"


# ---------------------------------------------------------------- running


@dataclasses.dataclass
class CompileCount:
    """Decode programs compiled while one rule's points ran (compile_cache.compiled_programs() added), by
    batch shape."""

    programs: int = 0
    shapes: list = dataclasses.field(default_factory=list)  # [batch, padded prompt length] of each program
    per_point: list = dataclasses.field(default_factory=list)  # programs added by each point, in run order


def decode_programs_since(seen: int) -> list:
    """The decode programs compiled in this process after the first `seen` programs of any kind."""
    return [p for p in compiled_programs()[seen:] if p.kind.startswith("decode/")]


def score_points(model, groups: dict[str, list[str]], eval_settings: EvalSettings, task, out: Path,
                 progress) -> tuple[dict, list[dict], dict[str, CompileCount], int]:
    """Every point through eval_gsm8k's lm-eval pass: (results by spec, sample rows, compile counts by rule,
    batches generated)."""
    results, rows, compiles, batches = {}, [], {}, 0
    total = sum(map(len, groups.values()))
    done = 0
    for name, specs in groups.items():
        count = compiles[name] = CompileCount()
        for spec in specs:
            seen = len(compiled_programs())
            t0 = time.time()
            lm, samples, generated = run_strategy(model, spec, eval_settings, task, out, progress)
            new = decode_programs_since(seen)
            count.programs += len(new)
            count.shapes += [list(p.shapes[0]) for p in new]  # the token ids [B, P] come first
            count.per_point.append(len(new))
            batches += generated
            point_rows = collect(spec, lm, samples)
            rows += point_rows
            results[spec] = {"rule": name, **summarize(point_rows), "batches_generated": generated,
                             **rule_record(lm.cfg)}  # the full spec and the digest of the rule's code
            done += 1
            r = results[spec]
            print(f"[{done}/{total}] {spec}: {r[METRIC]:.3f} strict, mean NFE {r['mean_nfe']:.2f}, "
                  f"{r['tokens_per_second']:.1f} tok/s ({generated} batches generated, {len(new)} programs "
                  f"compiled, {time.time() - t0:.0f}s)", flush=True)
    return results, rows, compiles, batches


def figure4_record(results: dict, series: dict, center: dict) -> dict:
    baseline = point_spec(BASELINE, {})
    keep = (METRIC, "accuracy_flexible", "mean_nfe", "tokens_per_second")
    return {"center": center, "center_spec": point_spec("localleap", center),
            "baseline": {"spec": baseline, **{k: results[baseline][k] for k in keep}},
            "ablations": {key: [{"value": value, "spec": spec, **{k: results[spec][k] for k in keep}}
                                for value, spec in values] for key, values in series.items()}}


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    progress = Progress()
    return exit_status(lambda: run(args, progress), progress)


def run(args, progress) -> int:
    # Everything that can be checked cheaply is checked before anything is created or loaded.
    out = Path(args.output).expanduser().resolve()
    check_output(out)
    path, manifest = find_checkpoint(args.model or args.checkpoint or cli.DEFAULT_CHECKPOINT)
    eval_settings = eval_settings_of(args, manifest, read_model_config(path))
    check_gen_length(eval_settings.gen_length, path)
    grids, pareto, series = plan_points(args, eval_settings)
    groups = run_order(pareto, series)
    plan = plan_data(args.data, args.fewshot_data, eval_settings.num_fewshot, manifest)

    with holding(out, progress):  # one run at a time holds the directory
        model = load_model(path, args.dtype)
        task = write_task(plan, out)
        print(f"model {path} ({model.config.num_params / 1e6:.1f}M params, {model.dtype}); data: {plan.description}; "
              f"limit {args.limit}; {sum(map(len, groups.values()))} points over {len(groups)} rules; output {out}")
        results, rows, compiles, batches = score_points(model, groups, eval_settings, task, out, progress)
        record = sweep_record(args, grids, eval_settings, path, model, plan, task, results, pareto, series, compiles,
                              batches)
        write_outputs(out, record, rows, pareto, series)
    print_report(record)
    print(f"\nwrote {', '.join(sorted(p.name for p in out.glob('*.png')))}, sweep.json and samples.jsonl in {out}")
    return 0


def sweep_record(args, grids, eval_settings, path, model, plan, task, results, pareto, series, compiles,
                 batches) -> dict:
    n = min(r["n"] for r in results.values())
    config = {**config_record(eval_settings, args.cache, path, model, plan, task), "grids": args.grids,
              "grid": grids,  # the grids swept
              "metric": METRIC}
    return {
        "config": config,
        "points": results,
        "pareto": pareto_record(results, pareto),
        "comparison": answer(results, pareto, n),
        "figure4": None if series is None else figure4_record(results, series, args.center),
        "compiles": {name: dataclasses.asdict(c) for name, c in compiles.items()},
        "batches_generated": batches,
    }


def write_outputs(out: Path, record: dict, rows: list[dict], pareto: dict, series) -> None:
    from localleap_jax.commands import plots

    plots.pareto_plot(out / "pareto.png", record["points"], record["pareto"], METRIC)
    if series is not None:
        plots.figure4_plot(out / "figure4.png", record["figure4"], METRIC)
    write_atomically(out / "samples.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    write_atomically(out / "sweep.json", json.dumps(plots.jsonable(record), indent=1, allow_nan=False))


def print_report(record: dict) -> None:
    points = record["points"]
    print(f"\n{'point':<44}{'strict':>8}{'mean NFE':>10}{'tok/s':>9}  frontier")
    for name, p in record["pareto"].items():
        for spec in p["points"]:
            on = "*" if spec in p["frontier_mean_nfe"] else ""
            r = points[spec]
            print(f"{spec:<44}{r[METRIC]:>8.3f}{r['mean_nfe']:>10.2f}{r['tokens_per_second']:>9.1f}  {on}")
    f4 = record["figure4"]
    if f4 is not None:
        b = f4["baseline"]
        print(f"\nFigure 4 (centre {f4['center_spec']}; baseline {b['spec']}: {b[METRIC]:.3f} strict, mean NFE "
              f"{b['mean_nfe']:.1f}, {b['tokens_per_second']:.1f} tok/s)")
        for key, series in f4["ablations"].items():
            print(f"  {key:<7}" + "  ".join(f"{s['value']:g}: {s[METRIC]:.3f}/{s['mean_nfe']:.2f} NFE/"
                                            f"{s['tokens_per_second']:.0f} tok/s" for s in series))
    counts = ", ".join(f"{name} {c['programs']}" for name, c in record["compiles"].items())
    print(f"\nprograms compiled this run, per rule: {counts}; batches generated: {record['batches_generated']}")
    c = record["comparison"]
    print(f"\n{c['question']}\n  {c['answer']}")
    if "tokens_per_second" in c:
        print(f"  on tokens/s: {sentence(c['tokens_per_second'], 'tokens/s')}")

