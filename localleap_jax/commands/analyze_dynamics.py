"""Decoding dynamics of a diffusion LM: the paper's Figures 1a, 1b, 1c and 2 from per-pass traces.

    python experiments/analyze_dynamics.py --output runs/dynamics              # embedded chain model, offline, CPU
    python experiments/analyze_dynamics.py --checkpoint DIR --data test.jsonl --limit 200 --output runs/d
    python experiments/analyze_dynamics.py --strategy localleap --output runs/d-leap
    python experiments/analyze_dynamics.py --rules path/to/myrules.py --strategy steady:k=2 --output runs/d-mine
    python experiments/analyze_dynamics.py --from-traces runs/dynamics/traces --output runs/again

Generation: each problem becomes lm-eval's 0-shot GSM8K prompt ("Question: ...\\nAnswer:") in the
chat template, decoded by `localleap_jax.generate(..., trace=True)` in batches; by default under the
paper's setting, LLaDA's `low_confidence` with one token per step. Every batch's trace goes to
DIR/traces/batch-NNNNN.npz (`localleap_jax.trace.save_trace`, with the decoded texts and the
settings), so `--from-traces` reruns the analysis without the model, and a rerun with the same
settings and the same rule code (its digest is in the settings: an edited rule traces again) reuses the
batches already there.

Analysis: DIR/figure1a.png (one sample, `--row`), figure1b.png, figure1c.png, figure2.png, each with a
JSON of its numbers, and DIR/dynamics.json ({"stable_within_25pct", "consistent_given_conf_gt_0.8",
counts, settings}); the two headline numbers are printed next to the paper's (63.7%, 97.8% on
LLaDA-8B). Definitions: `localleap_jax/dynamics.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from localleap_jax import cli
from localleap_jax.gsm8k import (RULES_HELP, UserError, held_output, load_user_rules, model_defaults,
                                 read_gsm8k_jsonl)

GENERATION_FLAGS = ("checkpoint", "data", "limit", "strategy", "rules", "gen_length", "block_length", "batch_size",
                    "cache", "early_stop", "dtype", "no_compile_cache")


def parse_args(argv=None):
    ap = cli.OneLineParser(prog="python experiments/analyze_dynamics.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="converted checkpoint directory, or embedded-chain (the default: "
                                         "tiny-chain), embedded (tiny-math), embedded-sdar")
    ap.add_argument("--data", help="GSM8K-format JSONL (question, answer) (default: the embedded model's held-out "
                                   "synthetic split)")
    ap.add_argument("--limit", type=cli.positive, help="analyse only the first N problems (default: all of them)")
    ap.add_argument("--strategy", help="decoding rule, a name or 'name:key=value,...' (default: low_confidence, "
                                       "one token per step, the paper's setting)")
    ap.add_argument("--rules", action="append", metavar="FILE.py|MODULE", help=RULES_HELP.replace("--strategies",
                                                                                                   "--strategy"))
    ap.add_argument("--gen-length", type=cli.positive, help="generation canvas (default 256; the embedded model's own: 64)")
    ap.add_argument("--block-length", type=cli.positive, help="block size (default 32; embedded model: 16)")
    ap.add_argument("--batch-size", type=cli.positive, help="rows per generate call (default 16)")
    ap.add_argument("--cache", help="cache policy: auto (default: block for a block-diffusion model, else none), none, "
                                    "prefix, dual, block, or the field's (dllm_cache, dkv, d2cache, vicinity; "
                                    "name:setting=value,...)")
    ap.add_argument("--early-stop", action="store_true", default=None,
                    help="stop a row after a finished block that holds EOS")
    ap.add_argument("--dtype", choices=cli.DTYPES, help=cli.DTYPE_HELP)
    ap.add_argument("--no-compile-cache", action="store_true", default=None,
                    help="do not use JAX's persistent compilation cache")
    ap.add_argument("--from-traces", nargs="+", metavar="FILE",
                    help="analyse saved trace files (or directories of them) instead of generating")
    ap.add_argument("--row", type=cli.count, default=0, help="the sample Figure 1a draws (default 0)")
    ap.add_argument("--output", required=True, help="output directory")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- settings


def decode_config(args, ll, model_config=None):
    """The DecodeConfig of --strategy (a rule name with optional settings) and the canvas flags, checked
    against the model's config.json when given."""
    spec = args.strategy or "low_confidence"
    try:
        return ll.DecodeConfig(strategy=ll.rule(spec), gen_length=args.gen_length, block_length=args.block_length,
                               cache=args.cache or "auto", early_stop=bool(args.early_stop)).validate(model_config)
    except ll.DecodeError as e:
        hint = "; a rule of your own: --rules path/to/myrules.py" if str(e).startswith("unknown strategy") else ""
        raise UserError(f"--strategy {spec}: {e}{hint}") from None


def load_problems(args, manifest: dict) -> tuple[list[dict], str]:
    """(problems, description): --data, else the embedded model's held-out synthetic split."""
    if args.data:
        path = Path(args.data).expanduser()
        rows = read_gsm8k_jsonl(path, scored=False)  # only the questions are read
        desc = str(path.resolve())
    elif manifest.get("eval_data") == "synthetic_math":
        from localleap_jax import synthetic_math
        spec = manifest.get("eval_data_spec", {"n": 500, "seed": 0})
        rows, desc = synthetic_math.split_of(spec)
    else:
        raise UserError("this checkpoint ships no evaluation problems: pass --data FILE.jsonl "
                        "(e.g. ../shared/data/gsm8k/test.jsonl)")
    return rows[:args.limit] if args.limit is not None else rows, desc


def prompt_text(question: str) -> str:
    """lm-eval's gsm8k doc_to_text, 0-shot (the chat template is applied on top)."""
    return f"Question: {question}\nAnswer:"


# ---------------------------------------------------------------- generation (the only part that needs the model)


def saved_with(path: Path, meta: dict) -> bool:
    """True when `path` is a readable trace file saved with exactly this meta (same model, settings, prompts); what
    the generation found (`hit_bound`) is not a setting."""
    from localleap_jax.trace import load_trace

    try:
        return path.is_file() and {k: v for k, v in load_trace(path)[2].items() if k != "hit_bound"} == meta
    except Exception:  # noqa: BLE001 - a torn or foreign file is simply regenerated
        return False


class Traced:
    """What this run has kept so far, for the line an interrupted run ends with: the trace files of the batches
    finished (this run's and those an earlier run left with the same settings) and the problems they hold."""

    def __init__(self, out: Path):
        self.out = out
        self.batches = self.rows = 0
        self.new_batches = 0  # written by this run
        self.analysed = False
        self.discarded = False  # the output directory was removed: this run had made it and produced nothing
        self.from_traces = False  # the run analyses saved traces (--from-traces): it generates none

    def produced(self) -> bool:
        return self.new_batches > 0 or self.analysed

    def interrupted(self, why: str) -> str:
        if self.from_traces:
            return f"interrupted ({why}) before the analysis was written; the trace files are as they were"
        if self.discarded or not self.batches:
            return f"interrupted ({why}) before any batch was traced; nothing was kept"
        return (f"interrupted ({why}): kept the traces of {self.batches} finished batches ({self.rows} problems) in "
                f"{self.out / 'traces'}; rerun the same command to go on from them")


def save_atomically(path: Path, trace, texts, meta: dict) -> None:
    """`save_trace` into a temporary file renamed over `path`: a run ended mid-write leaves no torn trace."""
    from localleap_jax.trace import save_trace

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_trace(tmp, trace, texts, meta)
    os.replace(tmp, path)


def generate_traces(model, prompts: list[str], cfg, batch_size: int, trace_dir: Path, meta: dict,
                    traced: Traced) -> list[Path]:
    """Generate `prompts` in batches with trace=True; one trace file per batch, reused when its settings match. A
    Ctrl-C stops between two batches (`cli.stopping_between_steps`): every finished batch's file is kept."""
    import numpy as np
    from tqdm import tqdm

    import localleap_jax as ll
    from localleap_jax.tokenizer import left_pad

    tok = model.tokenizer
    max_prompt = model.config.max_sequence_length - cfg.gen_length
    paths = []
    with cli.stopping_between_steps():
        bar = tqdm(total=len(prompts), desc=f"trace [{meta['strategy']}]", dynamic_ncols=True)
        try:
            for n, start in enumerate(range(0, len(prompts), batch_size)):
                cli.stop_if_asked()
                batch = prompts[start:start + batch_size]
                path = trace_dir / f"batch-{n:05d}.npz"
                batch_meta = {**meta, "prompts": batch, "first_row": start}
                if not saved_with(path, batch_meta):  # else done in an earlier run with these settings
                    ids, mask = left_pad([tok.encode(p, chat=True)[-max_prompt:] for p in batch], tok.pad_id)
                    try:
                        out = ll.generate(model, ids, mask, cfg, trace=True)
                    except ll.DecodeError as e:  # a user's rule that fails while traced (before anything ran)
                        raise UserError(str(e)) from None
                    trace_dir.mkdir(parents=True, exist_ok=True)  # only once there is a trace to save
                    hit_bound = [bool(h) for h in (out.hit_bound if out.hit_bound is not None else [False] * len(batch))]
                    save_atomically(path, out.trace, tok.decode_generated(out), {**batch_meta, "hit_bound": hit_bound})
                    traced.new_batches += 1
                    bar.set_postfix(nfe=f"{float(np.mean(out.nfe)):.1f}")
                paths.append(path)
                traced.batches += 1
                traced.rows += len(batch)
                bar.update(len(batch))
        finally:
            bar.close()
    for stale in sorted(trace_dir.glob("batch-*.npz"))[len(paths):]:  # from an earlier, longer run: not this one's
        stale.unlink()
    return paths


def plan_generation(args):
    """Everything the generation needs that is checked without loading the model: (opened checkpoint, decode
    config, problems, their description). One line for each mistake."""
    import localleap_jax as ll
    from localleap_jax import checkpoint
    from localleap_jax.resolve import resolve_checkpoint

    try:
        opened = checkpoint.open_checkpoint(resolve_checkpoint(args.checkpoint or cli.DEFAULT_CHECKPOINT))
    except (ll.CheckpointError, ll.ConfigError) as e:
        raise UserError(str(e)) from None
    load_user_rules(args.rules)
    defaults = model_defaults(opened.manifest, opened.config)
    for key in ("gen_length", "block_length"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    cfg = decode_config(args, ll, opened.config)
    problems, data_desc = load_problems(args, opened.manifest)
    if not 0 <= args.row < len(problems):
        raise UserError(f"--row {args.row}: there are {len(problems)} problems")
    return opened, cfg, problems, data_desc


def generate_and_save(args, plan, out: Path, traced: Traced) -> list[Path]:
    """Load the model and generate the planned problems' traces; returns the trace files."""
    import localleap_jax as ll
    from localleap_jax import checkpoint
    from localleap_jax.lm_eval import default_dtype

    opened, cfg, problems, data_desc = plan
    if not args.no_compile_cache:
        from localleap_jax.compile_cache import enable_compilation_cache
        enable_compilation_cache()
    dtype = args.dtype or "auto"
    try:
        model = checkpoint.load(opened, dtype=default_dtype() if dtype == "auto" else dtype)
    except (ll.CheckpointError, ll.ConfigError, ValueError) as e:
        raise UserError(str(e)) from None
    spec = args.strategy or "low_confidence"
    identity = ll.rules.code_identity(cfg.rule)
    meta = {"checkpoint": str(opened.path), "dtype": str(model.dtype), "data": data_desc, "strategy": spec,
            "decode": cfg.fingerprint(), "spec": cfg.rule.spec(),  # the rule with every setting
            "rule_code": identity["code"], "rule_defined_in": identity["defined_in"],
            "cache_mode": cfg.cache_mode(model.config)}  # "auto" resolved: what the stable share means
    print(f"model {opened.path} ({model.config.num_params / 1e6:.1f}M params, {model.dtype}); data: {data_desc}, "
          f"{len(problems)} problems; strategy {spec}, gen {cfg.gen_length}, block {cfg.block_length}; output {out}")
    prompts = [prompt_text(p["question"]) for p in problems]
    return generate_traces(model, prompts, cfg, args.batch_size or 16, out / "traces", meta, traced)


# ---------------------------------------------------------------- analysis (from trace files alone)


def trace_files(names: list[str]) -> list[Path]:
    """The .npz files named, directories expanded to the .npz files they hold (sorted)."""
    files = []
    for name in names:
        p = Path(name).expanduser()
        if p.is_dir():
            found = sorted(p.glob("*.npz"))
            if not found:
                raise UserError(f"--from-traces {p}: the directory holds no .npz trace files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"--from-traces {p}: no such file or directory")
    return files


def load_traces(files: list[Path]):
    """(trace of all rows, texts, meta of the first file); one line for a file that is not a trace or a mix of runs."""
    from localleap_jax.dynamics import concat_traces
    from localleap_jax.trace import load_trace

    traces, texts, metas, hit_bound = [], [], [], []
    for f in files:
        try:
            trace, t, meta = load_trace(f)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{f} is not a trace file written by save_trace ({type(e).__name__}: {e})") from None
        traces.append(trace)
        texts += t if t is not None else [None] * trace.token.shape[0]
        metas.append(meta)
        hit_bound += meta.get("hit_bound") or [None] * trace.token.shape[0]  # None: a file from before it was kept
    runs = {json.dumps({k: m.get(k) for k in ("checkpoint", "decode", "rule_code")}, sort_keys=True) for m in metas}
    if len(runs) > 1:
        raise UserError(f"the trace files come from {len(runs)} different runs (checkpoint, decode settings or rule "
                        "code); analyse each run on its own")
    try:
        return concat_traces(traces), texts, {**metas[0], "hit_bound": hit_bound}
    except ValueError as e:
        raise UserError(str(e)) from None


def analyse(files: list[Path], out: Path, row: int) -> dict:
    """Every figure and DIR/dynamics.json from trace files; returns dynamics.json's dict."""
    from localleap_jax.commands import plots
    from localleap_jax import dynamics as dyn

    trace, texts, meta = load_traces(files)
    if not 0 <= row < trace.token.shape[0]:
        raise UserError(f"--row {row}: the traces hold {trace.token.shape[0]} rows")
    cache = meta.get("cache_mode") or (meta.get("decode") or {}).get("cache")  # what the stable share means
    cache = None if cache == "auto" else cache
    figures = plots.all_figures(trace, out, row, texts, cache=cache)
    hit_bound = meta["hit_bound"]
    result = {**dyn.summary(trace, cache=cache), "paper": dyn.PAPER,
              # rows stopped by the pass bound (max_passes) with masks left: their statistics cover the passes they
              # ran (None: traces saved before this was recorded)
              "hit_bound": None if None in hit_bound else sum(hit_bound),
              "hit_bound_rows": None if None in hit_bound else [i for i, h in enumerate(hit_bound) if h],
              "figures": {name: f"{name}.png" for name in figures},
              "trace_files": [str(f.resolve()) for f in files],
              "settings": {k: v for k, v in meta.items() if k not in ("prompts", "first_row", "hit_bound")}}
    plots.write_json(out / "dynamics.json", result)
    return plots.jsonable(result)


def print_headline(result: dict) -> None:
    def pct(x):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"

    paper = result["paper"]
    print(f"\n{'':<44}{'this run':>10}{'paper':>9}")
    print(f"{'stable within 25% of the passes (Fig. 1b)':<44}{pct(result['stable_within_25pct']):>10}"
          f"{pct(paper['stable_within_25pct']):>9}   ({result['decided_positions']} positions)")
    print(f"{'consistent given confidence > 0.8 (Fig. 1c)':<44}{pct(result['consistent_given_conf_gt_0.8']):>10}"
          f"{pct(paper['consistent_given_conf_gt_0.8']):>9}   ({result['predictions_conf_gt_0.8']} predictions)")
    if result.get("hit_bound"):
        print(f"{'rows stopped by the pass bound, masks left':<44}{result['hit_bound']:>10}{'-':>9}   (of {result['rows']}; "
              f"rows {', '.join(map(str, result['hit_bound_rows'][:10]))}{', ...' if result['hit_bound'] > 10 else ''}: "
              "their statistics cover only the passes they ran)")
    cache = result.get("cache")
    if cache != "none":  # the paper's figure is without a cache: say what this one is
        print(f"note: stable share with --cache {cache or '(not recorded)'}: {result['stable_within_25pct_means']} "
              f"({pct(result['observed_share_of_masked_predictions'])} of the masked positions' passes predicted them)")
    revoked = result.get("revocations") or {}
    if revoked.get("remasks"):
        print(f"{'tokens taken back (remasks per answer)':<44}{revoked['remasks_per_row']:>10.2f}{'-':>9}   "
              f"({revoked['remasks']} in all; by clause {revoked['by_clause']}; by tenth of the generated region "
              f"{revoked['by_tenth_of_the_region']})")
    edited = result.get("edits") or {}
    if edited.get("edits"):
        print(f"{'tokens replaced (edits per answer)':<44}{edited['edits_per_row']:>10.2f}{'-':>9}   "
              f"({edited['edits']} in all; by clause {edited['by_clause']}; by tenth of the generated region "
              f"{edited['by_tenth_of_the_region']})")
    if edited.get("inserts") or edited.get("deletes"):
        print(f"{'positions inserted / dropped (in all)':<44}{edited['inserts']:>10}{edited['deletes']:>9}")


def main(argv=None) -> int:
    args = parse_args(argv)
    traced = Traced(Path(args.output).expanduser().resolve())
    return cli.run_command(lambda: run(args, traced), traced.interrupted)


def run(args, traced: Traced) -> int:
    out = cli.check_writable_dir(args.output, "--output")  # before the model loads, not after its traces
    traced.from_traces = bool(args.from_traces)
    if args.from_traces:
        given = [f"--{k.replace('_', '-')}" for k in GENERATION_FLAGS if getattr(args, k) is not None]
        if given:
            raise UserError(f"--from-traces analyses saved traces; {', '.join(given)} only apply when generating")
        files = trace_files(args.from_traces)
    else:
        plan = plan_generation(args)  # every setting checked before the output is claimed or the model loads
    # One run writes into --output at a time (OUT/.lock, as eval_gsm8k and eval_likelihood): removed again if this
    # run made it and nothing came of it.
    with held_output(out, traced.produced, lambda: setattr(traced, "discarded", True)):
        if not args.from_traces:
            files = generate_and_save(args, plan, out, traced)
        result = analyse(files, out, args.row)
        traced.analysed = True
    print_headline(result)
    print(f"\nwrote {out / 'dynamics.json'} and {', '.join(result['figures'].values())} in {out}")
    return 0
