"""GSM8K with lm-eval-harness's protocol, decoding strategies side by side.

    python experiments/eval_gsm8k.py                       # the embedded small model, offline, a few minutes on CPU
    python experiments/eval_gsm8k.py --model GSAI-ML/LLaDA-8B-Instruct          # GPU/TPU: converts once, then reuses
    python experiments/eval_gsm8k.py --checkpoint DIR --data test.jsonl --limit 200

lm-eval provides the task (few-shot prompts, stop strings), the filters (`strict-match`,
`flexible-extract`) and the metric; `localleap_jax.lm_eval_adapter` only generates. Every
strategy runs on the same items. Results go to --output: samples.jsonl (one line per sample and
strategy), summary.json, and lm-eval's response cache, so rerunning with the same --output skips
what is done (also after an interruption mid-strategy).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

DEFAULTS = {"gen_length": 256, "block_length": 32, "num_fewshot": 5}  # the papers' GSM8K setting
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k strict-match, for the live progress display only
LLADA_HINT = ("To evaluate LLaDA-8B-Instruct (GPU/TPU, internet for the first run): "
              "python experiments/eval_gsm8k.py --model GSAI-ML/LLaDA-8B-Instruct --limit 200")


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="converted checkpoint directory (default: the embedded small model)")
    src.add_argument("--model", help="hub id, e.g. GSAI-ML/LLaDA-8B-Instruct: converted once into "
                                     "~/.cache/localleap_jax/checkpoints and reused")
    ap.add_argument("--data", help="GSM8K-format JSONL (question, answer) to evaluate on (default: the embedded "
                                   "model's held-out synthetic split, or lm-eval's gsm8k from the hub)")
    ap.add_argument("--fewshot-data", help="JSONL to draw few-shot examples from (default: train.jsonl beside --data)")
    ap.add_argument("--strategies", default="low_confidence,threshold,localleap",
                    help="comma-separated; the first is the baseline of the ratios (default: %(default)s)")
    ap.add_argument("--limit", type=int, help="evaluate only the first N problems")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--gen-length", type=int, help="generation canvas (default 256; the embedded model's own: 64)")
    ap.add_argument("--block-length", type=int, help="block size (default 32; embedded model: 16)")
    ap.add_argument("--num-fewshot", type=int, help="few-shot examples (default 5; embedded model: 0)")
    ap.add_argument("--steps", type=int, help="low_confidence steps (default gen_length: one token per step)")
    ap.add_argument("--kappa", type=float, default=0.9, help="anchor / threshold confidence (default 0.9)")
    ap.add_argument("--tau", type=float, default=0.75, help="relaxed threshold near an anchor (default 0.75)")
    ap.add_argument("--radius", type=int, default=4, help="W, the anchor neighbourhood (default 4)")
    ap.add_argument("--cache", default="none",
                    help="KV cache: none, prefix or dual (default none); a comma-separated list runs each, names the "
                         "rows strategy+cache and reports the fraction of outputs identical to the first mode's")
    ap.add_argument("--early-stop", action="store_true", help="stop a row after a finished block that holds EOS")
    ap.add_argument("--dtype", default="auto", help="parameter dtype: auto (fp32 on CPU, bf16 on GPU/TPU), "
                                                    "bfloat16, float32")
    ap.add_argument("--output", help="output directory (default runs/eval_gsm8k/<model>)")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent compilation cache")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# ---------------------------------------------------------------- inputs


def read_gsm8k_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"--data {path}: no such file")
    rows = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not {"question", "answer"} <= row.keys():
            raise UserError(f"{path}:{n} needs the keys 'question' and 'answer'")
        rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no problems")
    return rows


def local_task(out: Path, test: Path, fewshot: Path) -> tuple[str, Path]:
    """An lm-eval task that is the stock gsm8k task (prompts, filters, metric) on local JSONL files."""
    import lm_eval

    stock = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    tasks = out / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "gsm8k_local.yaml").write_text(
        f"include: {json.dumps(str(stock))}\n"
        "task: gsm8k_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        "dataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(test.resolve()))}\n    train: {json.dumps(str(fewshot.resolve()))}\n")
    return "gsm8k_local", tasks


def resolve_data(args, manifest: dict, out: Path) -> tuple[str, Path | None, str]:
    """(lm-eval task name, include path or None, description of the data)."""
    if args.data:
        test = Path(args.data).expanduser()
        read_gsm8k_jsonl(test)
        fewshot = Path(args.fewshot_data).expanduser() if args.fewshot_data else test.with_name("train.jsonl")
        if args.fewshot_data:
            read_gsm8k_jsonl(fewshot)
        elif not fewshot.is_file():
            fewshot = test  # no train split beside it: few-shot examples come from the same file
        name, include = local_task(out, test, fewshot)
        return name, include, str(test.resolve())
    if manifest.get("eval_data") == "synthetic_math":
        import synthetic_math
        data = out / "data"
        data.mkdir(parents=True, exist_ok=True)
        spec = manifest.get("eval_data_spec", {"n": 500, "seed": 0})
        synthetic_math.write_jsonl(synthetic_math.take("test", spec["n"], spec["seed"]), str(data / "test.jsonl"))
        synthetic_math.write_jsonl(synthetic_math.take("train", 50, spec["seed"]), str(data / "train.jsonl"))
        name, include = local_task(out, data / "test.jsonl", data / "train.jsonl")
        return name, include, f"synthetic_math test split ({spec['n']} held-out problems, seed {spec['seed']})"
    return "gsm8k", None, "lm-eval gsm8k (openai/gsm8k from the Hugging Face hub)"


# ---------------------------------------------------------------- running


class RunningAccuracy:
    """Live strict-match accuracy for the progress bar (the reported numbers come from lm-eval)."""

    def __init__(self):
        self.correct = self.n = 0
        self.postfix = {}

    def __call__(self, requests, texts, stats):
        for req, text in zip(requests, texts):
            gold = str(req.doc["answer"]).split("####")[-1].strip().replace(",", "")
            m = STRICT.search(text)
            self.correct += bool(m) and m.group(1).replace(",", "").rstrip(".") == gold
            self.n += 1
        self.postfix = {"acc": f"{self.correct / self.n:.3f}"}


def run_strategy(model, strategy: str, cache_mode: str, args, task: str, include: Path | None, data_desc: str,
                 out: Path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from localleap_jax import DecodeConfig
    from localleap_jax.lm_eval_adapter import LocalLeapLM

    cfg = DecodeConfig(strategy=strategy, gen_length=args.gen_length, block_length=args.block_length,
                       kappa=args.kappa, tau=args.tau, radius=args.radius,
                       steps=args.steps if strategy == "low_confidence" else None,
                       early_stop=args.early_stop, cache=cache_mode)
    fingerprint = hashlib.sha256(json.dumps([str(model.path), str(model.dtype), dataclasses.asdict(cfg),
                                             args.num_fewshot, data_desc]).encode()).hexdigest()[:12]
    cache = out / "cache" / f"{strategy}-{fingerprint}"
    lm = LocalLeapLM(model=model, batch_size=args.batch_size, stats_path=f"{cache}.stats.jsonl",
                     compile_cache=not args.no_compile_cache, seed=args.seed, on_batch=RunningAccuracy(),
                     **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(include) if include else None),
                                      num_fewshot=args.num_fewshot, limit=args.limit, use_cache=str(cache),
                                      log_samples=True, bootstrap_iters=0, random_seed=args.seed)
    except (ConnectionError, OSError, FileNotFoundError) as e:
        if include is None:
            raise UserError(f"could not load GSM8K from the Hugging Face hub ({type(e).__name__}); offline, pass "
                            f"--data FILE.jsonl (e.g. ../shared/data/gsm8k/test.jsonl)") from None
        raise
    samples = res["samples"][task]
    return lm, samples


def collect(strategy: str, lm, samples: list[dict]) -> list[dict]:
    """One row per problem: lm-eval's filtered answers and scores, joined with our NFE/timing stats."""
    from localleap_jax.lm_eval_adapter import prompt_key

    by_doc: dict[int, dict] = {}
    for s in samples:
        context = s["arguments"][0][0]
        row = by_doc.setdefault(s["doc_id"], {
            "id": s["doc"].get("id", s["doc_id"]), "strategy": strategy,
            "question": s["doc"]["question"], "generated": s["resps"][0][0],
            "gold": str(s["doc"]["answer"]).split("####")[-1].strip(), "_key": prompt_key(context)})
        tag = "strict" if s["filter"] == "strict-match" else "flexible"
        row[f"filtered_{tag}"] = s["filtered_resps"][0]
        row[f"correct_{tag}"] = bool(s["exact_match"])
    rows = []
    for doc_id in sorted(by_doc):
        row = by_doc[doc_id]
        st = lm.stats.get(row.pop("_key"), {})
        row.update(prompt_tokens=st.get("prompt_tokens"), nfe=st.get("nfe"), seconds=st.get("seconds"),
                   generated_tokens=st.get("generated_tokens"), compile_seconds=st.get("compile_seconds", 0.0))
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    timed = [r for r in rows if r["seconds"] is not None]
    seconds = sum(r["seconds"] for r in timed)
    return {
        "n": n,
        "accuracy_strict": sum(r["correct_strict"] for r in rows) / n,
        "accuracy_flexible": sum(r["correct_flexible"] for r in rows) / n,
        "mean_nfe": sum(r["nfe"] for r in timed) / max(len(timed), 1),
        "tokens_per_second": sum(r["generated_tokens"] for r in timed) / max(seconds, 1e-9),
        "seconds_per_sample": seconds / max(len(timed), 1),
        "compile_seconds": sum(r["compile_seconds"] or 0.0 for r in rows),
    }


def print_table(summary: dict) -> None:
    names = list(summary)
    same_key = next((k for s in summary.values() for k in s if k.startswith("identical_to_")), None)
    width = max(16, max(map(len, names)) + 2)
    print(f"\n{'strategy':<{width}}{'strict':>8}{'flexible':>10}{'mean NFE':>10}{'NFE ratio':>11}{'speedup':>9}"
          f"{'tok/s':>9}{'s/sample':>10}{'compile s':>11}{'n':>6}" + (f"{'same':>7}" if same_key else ""))
    for name in names:
        s = summary[name]
        same = f"{s[same_key]:>7.2f}" if same_key and same_key in s else ("      -" if same_key else "")
        print(f"{name:<{width}}{s['accuracy_strict']:>8.3f}{s['accuracy_flexible']:>10.3f}{s['mean_nfe']:>10.1f}"
              f"{s['nfe_ratio']:>11.3f}{s['speedup']:>8.2f}x{s['tokens_per_second']:>9.1f}"
              f"{s['seconds_per_sample']:>10.4f}{s['compile_seconds']:>11.1f}{s['n']:>6}{same}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    import localleap_jax as ll
    from localleap_jax.checkpoint import read_manifest, resolve_checkpoint
    from localleap_jax.decode import DecodeError
    from localleap_jax.lm_eval_adapter import default_dtype

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    bad_cache = [c for c in caches if c not in ("none", "prefix", "dual")]
    if bad_cache or not caches:
        raise UserError(f"unknown cache {', '.join(bad_cache) or '(none given)'}; choose from none, prefix, dual")
    unknown = [s for s in strategies if s not in ll.STRATEGIES]
    if unknown or not strategies:
        raise UserError(f"unknown strategy {', '.join(unknown) or '(none given)'}; choose from "
                        f"{', '.join(sorted(ll.STRATEGIES))}")
    try:
        path = resolve_checkpoint(args.model or args.checkpoint)
        manifest = read_manifest(path)
        model = ll.load(path, dtype=default_dtype() if args.dtype == "auto" else args.dtype)
    except (ll.CheckpointError, ll.ConfigError) as e:
        raise UserError(str(e)) from None
    defaults = {**DEFAULTS, **manifest.get("eval_defaults", {})}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        ll.DecodeConfig(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                        kappa=args.kappa, tau=args.tau, radius=args.radius).validate()
    except DecodeError as e:
        raise UserError(str(e)) from None

    out = Path(args.output or REPO / "runs" / "eval_gsm8k" / path.name).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    task, include, data_desc = resolve_data(args, manifest, out)
    print(f"model {path} ({model.config.num_params / 1e6:.1f}M params, {model.dtype}); data: {data_desc}; "
          f"{args.num_fewshot}-shot, gen {args.gen_length}, block {args.block_length}, cache {args.cache}; "
          f"output {out}")

    summary, all_rows, texts = {}, [], {}
    for cache_mode in caches:
        for strategy in strategies:
            name = strategy if len(caches) == 1 else f"{strategy}+{cache_mode}"
            t0 = time.time()
            lm, samples = run_strategy(model, strategy, cache_mode, args, task, include, data_desc, out)
            rows = collect(name, lm, samples)
            all_rows += rows
            summary[name] = summarize(rows)
            texts[strategy, cache_mode] = [r["generated"] for r in rows]
            if cache_mode != caches[0]:  # how often the cached approximation changed nothing
                same = [a == b for a, b in zip(texts[strategy, cache_mode], texts[strategy, caches[0]])]
                summary[name][f"identical_to_{caches[0]}"] = sum(same) / len(same)
            print(f"{name}: {summary[name]['accuracy_strict']:.3f} strict, mean NFE "
                  f"{summary[name]['mean_nfe']:.1f} ({lm.model_calls} batches generated, {time.time() - t0:.0f}s)")
    first = next(iter(summary.values()))
    for s in summary.values():
        s["nfe_ratio"] = s["mean_nfe"] / max(first["mean_nfe"], 1e-9)
        s["speedup"] = first["seconds_per_sample"] / max(s["seconds_per_sample"], 1e-9)

    with open(out / "samples.jsonl", "w") as f:
        for row in all_rows:
            f.write(json.dumps(row) + "\n")
    config = {"checkpoint": str(path), "dtype": str(model.dtype), "data": data_desc, "task": task,
              "num_fewshot": args.num_fewshot, "gen_length": args.gen_length, "block_length": args.block_length,
              "steps": args.steps, "kappa": args.kappa, "tau": args.tau, "radius": args.radius,
              "cache": args.cache, "early_stop": args.early_stop, "limit": args.limit,
              "batch_size": args.batch_size, "seed": args.seed}
    (out / "summary.json").write_text(json.dumps({"strategies": summary, "config": config}, indent=2))
    print_table(summary)
    print(f"\nwrote {out / 'samples.jsonl'} and {out / 'summary.json'}")
    if path.resolve() == ll.checkpoint.EMBEDDED.resolve():
        print(LLADA_HINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
