"""GSM8K with lm-eval-harness's protocol, decoding strategies side by side.

    python experiments/eval_gsm8k.py                       # the embedded small model, offline, a few minutes on CPU
    python experiments/eval_gsm8k.py --model GSAI-ML/LLaDA-8B-Instruct          # GPU/TPU: converts once, then reuses
    python experiments/eval_gsm8k.py --checkpoint DIR --data test.jsonl --limit 200

lm-eval provides the task (few-shot prompts, stop strings), the filters (`strict-match`,
`flexible-extract`) and the metric; `localleap_jax.lm_eval_adapter` only generates. Every
strategy runs on the same items. Results go to --output: samples.jsonl (one line per sample and
strategy), summary.json, and lm-eval's response cache, so rerunning with the same --output skips
what is done (also after an interruption mid-strategy). The cache is keyed on what the answers
depend on (the weights' content, the tokenizer, the data's content, every setting that changes
tokens), so a changed model or setting is generated again, never read from an old run. One run
holds --output at a time (OUT/.lock names it).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

DEFAULTS = {"gen_length": 256, "block_length": 32, "num_fewshot": 5}  # the papers' GSM8K setting
CACHE_MODES = ("none", "prefix", "dual")  # decode.CACHE_MODES, without importing JAX to check a flag
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k strict-match, for the live progress display only
LLADA_HINT = ("To evaluate LLaDA-8B-Instruct (GPU/TPU, internet for the first run): "
              "python experiments/eval_gsm8k.py --model GSAI-ML/LLaDA-8B-Instruct --limit 200")
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line."""


# ---------------------------------------------------------------- command line


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a mistake in one `error: ...` line (its own prints the usage first)."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def whole_number(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


positive = whole_number(1, "a positive integer")
count = whole_number(0, "an integer >= 0")


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def seed(text: str) -> int:
    value = whole_number(0, "an integer >= 0")(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer below 2**32, got {value}")
    return value


def split_specs(text: str) -> list[str]:
    from localleap_jax.rules import split_specs as split
    return split(text)


def names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="converted checkpoint directory (default: the embedded small model)")
    src.add_argument("--model", help="hub id, e.g. GSAI-ML/LLaDA-8B-Instruct: converted once into "
                                     "~/.cache/localleap_jax/checkpoints and reused")
    ap.add_argument("--data", help="GSM8K-format JSONL (question, answer) to evaluate on (default: the embedded "
                                   "model's held-out synthetic split, or lm-eval's gsm8k from the hub)")
    ap.add_argument("--fewshot-data", help="JSONL to draw few-shot examples from (default: train.jsonl beside --data, "
                                           "else --data itself, never a problem's own example)")
    ap.add_argument("--strategies", default="low_confidence,threshold,localleap",
                    help="comma-separated rules, each a name with optional settings, e.g. "
                         "localleap,threshold:kappa=0.8,eb:gamma=0.01,klass:tau_c=0.6,tau_kl=0.015; the first is the "
                         "baseline of the ratios (default: %(default)s; names: low_confidence, threshold, localleap, "
                         "factor, eb, margin, entropy, klass, stable)"),
    ap.add_argument("--limit", type=positive, help="evaluate only the first N problems")
    ap.add_argument("--batch-size", type=positive, default=32)
    ap.add_argument("--gen-length", type=positive, help="generation canvas (default 256; the embedded model's own: 64)")
    ap.add_argument("--block-length", type=positive, help="block size (default 32; embedded model: 16)")
    ap.add_argument("--num-fewshot", type=count, help="few-shot examples (default 5; embedded model: 0)")
    ap.add_argument("--truncate-fewshot", action="store_true",
                    help="drop few-shot examples from the front of a prompt that is too long for the model (counted "
                         "in summary.json) instead of refusing the run")
    ap.add_argument("--steps", type=positive, help="steps of the rules on LLaDA's schedule (low_confidence, margin, "
                                                   "entropy, klass; default gen_length: one token per step)")
    ap.add_argument("--kappa", type=probability, help="anchor / threshold confidence of the rules that take it "
                                                      "(default: the rule's, 0.9); a rule's own setting wins")
    ap.add_argument("--tau", type=probability, help="relaxed threshold near an anchor (localleap; default 0.75)")
    ap.add_argument("--radius", type=count, help="W, the anchor neighbourhood (localleap; default 4)")
    ap.add_argument("--cache", default="none",
                    help="KV cache: none, prefix or dual (default none); a comma-separated list runs each, names the "
                         "rows strategy+cache and reports the fraction of outputs identical to the first mode's")
    ap.add_argument("--early-stop", action="store_true", help="stop a row after a finished block that holds EOS")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="parameter dtype: auto (fp32 on CPU, bf16 on GPU/TPU), bfloat16, float32")
    ap.add_argument("--output", help="output directory (default runs/eval_gsm8k/<model>)")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent compilation cache")
    ap.add_argument("--seed", type=seed, default=0)
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
    args.strategies, args.caches = split_specs(args.strategies), names(args.cache)
    for flag, given in (("--strategies", args.strategies), ("--cache", args.caches)):
        if not given:
            ap.error(f"argument {flag}: no names given")
        twice = sorted({n for n in given if given.count(n) > 1})
        if twice:
            ap.error(f"argument {flag}: {', '.join(twice)} given twice")
    bad_cache = [c for c in args.caches if c not in CACHE_MODES]
    if bad_cache:
        ap.error(f"argument --cache: unknown cache {', '.join(bad_cache)}; choose from {', '.join(CACHE_MODES)}")
    if args.fewshot_data and not args.data:
        ap.error("argument --fewshot-data: needs --data (the default data brings its own few-shot examples)")
    if args.mesh is not None:
        from localleap_jax.sharding import parse_mesh
        from localleap_jax.decode import DecodeError
        try:
            parse_mesh(args.mesh)
        except DecodeError as e:
            ap.error(f"argument --{e}")
    return args


# ---------------------------------------------------------------- inputs


def read_gsm8k_jsonl(path: Path, flag: str = "--data") -> list[dict]:
    if not path.is_file():
        raise UserError(f"{flag} {path}: " + ("is a directory, not a file" if path.is_dir() else "no such file"))
    rows = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {path}: cannot read it ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{flag} {path}:{n} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not {"question", "answer"} <= row.keys():
            raise UserError(f"{flag} {path}:{n} needs the keys 'question' and 'answer'")
        rows.append(row)
    if not rows:
        raise UserError(f"{flag} {path} holds no problems")
    return rows


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """Where the problems and few-shot examples come from, checked before anything is written."""

    description: str
    test: Path | None = None  # a GSM8K-format file (None: synthetic or the hub)
    fewshot: Path | None = None
    synthetic: dict | None = None  # the embedded model's split spec, written into OUT/data


def plan_data(args, manifest: dict) -> DataPlan:
    if args.data:
        test = Path(args.data).expanduser().resolve()
        n_test = len(read_gsm8k_jsonl(test))
        if args.fewshot_data:
            fewshot = Path(args.fewshot_data).expanduser().resolve()
            n_fewshot = len(read_gsm8k_jsonl(fewshot, "--fewshot-data"))
        else:
            beside = test.with_name("train.jsonl")
            fewshot = beside if beside.is_file() and beside != test else test
            n_fewshot = n_test if fewshot == test else len(read_gsm8k_jsonl(fewshot, "--fewshot-data"))
        available = n_fewshot - (fewshot == test)  # a problem never serves as its own example
        if args.num_fewshot > available:
            raise UserError(f"--num-fewshot {args.num_fewshot}: {fewshot} offers only {available} few-shot "
                            f"examples per problem")
        return DataPlan(str(test), test=test, fewshot=fewshot)
    if manifest.get("eval_data") == "synthetic_math":
        spec = manifest.get("eval_data_spec", {"n": 500, "seed": 0})
        if args.num_fewshot > 50:
            raise UserError(f"--num-fewshot {args.num_fewshot}: the synthetic few-shot split holds 50 examples")
        return DataPlan(f"synthetic_math test split ({spec['n']} held-out problems, seed {spec['seed']})",
                        synthetic=spec)
    return DataPlan("lm-eval gsm8k (openai/gsm8k from the Hugging Face hub)")


def local_task(out: Path, test: Path, fewshot: Path) -> tuple[str, Path]:
    """An lm-eval task that is the stock gsm8k task (prompts, filters, metric) on local JSONL files."""
    import lm_eval

    stock = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    tasks = out / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    # With one file for both, few-shot examples come from the test split itself, where lm-eval leaves
    # out the problem being asked (from a "train" split pointing at the same file it would not).
    fewshot_split = "test" if fewshot.resolve() == test.resolve() else "train"
    (tasks / "gsm8k_local.yaml").write_text(
        f"include: {json.dumps(str(stock))}\n"
        "task: gsm8k_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"fewshot_split: {fewshot_split}\n"
        "dataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(test.resolve()))}\n    train: {json.dumps(str(fewshot.resolve()))}\n")
    return "gsm8k_local", tasks


def file_digest(*paths: Path) -> str:
    """Content hash of the data files (the answers depend on what they hold, not where they are)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def write_task(plan: DataPlan, out: Path) -> tuple[str, Path | None, str]:
    """(lm-eval task name, include path or None, identity of the data's content) for a checked plan."""
    if plan.synthetic is not None:
        import synthetic_math

        data = out / "data"
        data.mkdir(parents=True, exist_ok=True)
        spec = plan.synthetic
        synthetic_math.write_jsonl(synthetic_math.take("test", spec["n"], spec["seed"]), str(data / "test.jsonl"))
        synthetic_math.write_jsonl(synthetic_math.take("train", 50, spec["seed"]), str(data / "train.jsonl"))
        test, fewshot = data / "test.jsonl", data / "train.jsonl"
    elif plan.test is not None:
        test, fewshot = plan.test, plan.fewshot
    else:
        return "gsm8k", None, "hub:openai/gsm8k"
    name, include = local_task(out, test, fewshot)
    return name, include, file_digest(test, fewshot)


# ---------------------------------------------------------------- the output directory


def check_output(out: Path) -> None:
    """Refuse an --output that cannot be a directory, before anything is loaded or created."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file, not a directory")
    parent = next(p for p in (out, *out.parents) if p.exists())
    if not parent.is_dir():
        raise UserError(f"--output {out}: {parent} is a file, not a directory")


class OutputDir:
    """The --output directory, held by one run at a time through OUT/.lock (the holder's pid and host).

    The lock is a kernel lock (flock) on that file, so it ends with its process however that process
    ends; the file only names the holder. A lock file left by a run that died is taken over with a note."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = path / ".lock"
        self.created: Path | None = None  # the topmost directory this run created, removed by discard()
        self._fd: int | None = None

    def claim(self) -> str | None:
        """Create and lock the directory; returns a note when a dead run's lock was taken over."""
        self.created = next((p for p in (*reversed(self.path.parents), self.path) if not p.exists()), None)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = self._holder(fd)
                    os.close(fd)
                    raise UserError(f"--output {self.path} is in use by another eval ({holder}); wait for it to "
                                    "finish or choose another --output") from None
                if self.lock.exists() and os.stat(self.lock).st_ino == os.fstat(fd).st_ino:
                    break
                os.close(fd)  # the holder removed the file between our open and flock: lock the new one
        except OSError as e:
            self.discard()
            raise UserError(f"--output {self.path}: cannot write there ({e.strerror})") from None
        self._fd = fd
        previous = self._holder(fd) if os.fstat(fd).st_size else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        if previous:
            return f"took over {self.lock}, left by a run that ended without releasing it ({previous})"
        return None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.lock.unlink()  # while still locked, so nobody locks the old file in between
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def discard(self) -> None:
        """Remove what this run created (used when it ends before producing anything)."""
        if self.created is not None and self.created.exists():
            shutil.rmtree(self.created, ignore_errors=True)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0))
            return f"pid {info['pid']} on {info['host']} since {info['since']}"
        except (ValueError, KeyError, TypeError, OSError):
            return "holder unknown"


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


@dataclasses.dataclass
class Progress:
    """What this run has produced so far, for the message of an interrupted run."""

    out: Path | None = None
    models: list = dataclasses.field(default_factory=list)  # every LocalLeapLM this run made
    discarded: bool = False

    @property
    def answers(self) -> int:
        return sum(lm.rows_generated for lm in self.models)

    def flush(self) -> None:
        """Let lm-eval's cache write what it has queued (its writer thread dies with the process)."""
        for lm in self.models:
            db = getattr(lm.cache_hook, "dbdict", None)
            if db is not None:
                try:
                    db.commit(blocking=True)
                except Exception:  # noqa: BLE001  (a cache that cannot commit loses answers the rerun redoes)
                    pass

    def interrupted(self, what: str) -> str:
        if self.out is None or self.discarded:
            return f"interrupted ({what}) before anything was generated; nothing was kept"
        return f"interrupted ({what}): {self.kept()}"

    def kept(self) -> str:
        """What a run that ends now leaves for the next one."""
        if self.out is None or self.discarded:
            return "nothing was kept"
        return (f"kept {self.answers} answers generated by this run (and all earlier ones) in {self.out / 'cache'}; "
                "rerun the same command to resume")


def decode_config(strategy: str, cache_mode: str, args):
    from localleap_jax import DecodeConfig

    return DecodeConfig(strategy=strategy, gen_length=args.gen_length, block_length=args.block_length,
                        kappa=args.kappa, tau=args.tau, radius=args.radius, steps=args.steps,
                        early_stop=args.early_stop, cache=cache_mode)


def resume_key(model, cfg, args, data_id: str) -> dict:
    """What a strategy's answers depend on (see lm_eval_adapter.answers_key); its digest names the cache."""
    import jax

    from localleap_jax.lm_eval_adapter import answers_key

    return answers_key(model, cfg, chat=True, seed=args.seed, truncate_fewshot=args.truncate_fewshot,
                       batch={"batch_size": args.batch_size, "limit": args.limit, "devices": jax.local_device_count(),
                              "mesh": None if args.mesh_shape is None else dict(args.mesh_shape)},
                       task={"data": data_id, "num_fewshot": args.num_fewshot})


def evaluate_once(model, cfg, key: dict, cache: Path, args, task: str, include: Path | None, progress: Progress):
    import lm_eval

    from localleap_jax.lm_eval_adapter import USER_ERRORS, LocalLeapLM, PromptTooLongError

    lm = LocalLeapLM(model=model, mesh=args.device_mesh, answers_key=key, batch_size=args.batch_size,
                     stats_path=f"{cache}.stats.jsonl",
                     compile_cache=not args.no_compile_cache, seed=args.seed, on_batch=RunningAccuracy(),
                     truncate_fewshot=args.truncate_fewshot,
                     **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    progress.models.append(lm)
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager(include),
                                      num_fewshot=args.num_fewshot, limit=args.limit, use_cache=str(cache),
                                      log_samples=True, bootstrap_iters=0, random_seed=args.seed)
    except PromptTooLongError as e:
        fix = ("even with every few-shot example dropped; lower --gen-length" if e.truncating else
               "pass --truncate-fewshot to drop few-shot examples, or lower --num-fewshot or --gen-length")
        raise UserError(f"{e.summary}; {fix}") from None
    except USER_ERRORS as e:
        raise UserError(str(e)) from None
    except (ConnectionError, OSError, FileNotFoundError) as e:
        if include is None:
            raise UserError(f"could not load GSM8K from the Hugging Face hub ({type(e).__name__}); offline, pass "
                            f"--data FILE.jsonl (e.g. ../shared/data/gsm8k/test.jsonl)") from None
        raise
    return lm, res["samples"][task]


def task_manager(include: Path | None):
    """lm-eval's task index. A local task includes the stock gsm8k.yaml by path, so the index needs only
    its own directory: indexing every stock task costs half a minute per strategy."""
    from lm_eval.tasks import TaskManager

    if include is None:
        return TaskManager()
    return TaskManager(include_path=str(include), include_defaults=False)


def forget_answers(lm, samples: list[dict]) -> None:
    """Delete these samples' answers from the response cache, so the next pass generates them again."""
    from lm_eval.api.model import hash_args

    db = lm.cache_hook.dbdict
    for s in samples:
        db.pop(hash_args("generate_until", s["arguments"][0]), None)
    db.commit()


def run_strategy(model, strategy: str, cache_mode: str, args, task: str, include: Path | None, data_id: str,
                 out: Path, progress: Progress):
    """lm-eval on one strategy; returns (LocalLeapLM of the last pass, samples, batches generated)."""
    from localleap_jax.lm_eval_adapter import key_digest, prompt_key

    cfg = decode_config(strategy, cache_mode, args)
    key = resume_key(model, cfg, args, data_id)
    cache = out / "cache" / f"{re.sub(r'[^A-Za-z0-9_.=-]+', '_', strategy)}-{key_digest(key)[:12]}"
    batches = 0
    for _ in range(2):
        lm, samples = evaluate_once(model, cfg, key, cache, args, task, include, progress)
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
    from localleap_jax.lm_eval_adapter import prompt_key

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
                   nfe=st.get("nfe"), seconds=st.get("seconds"), generated_tokens=st.get("generated_tokens"),
                   compile_seconds=st.get("compile_seconds", 0.0))
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
        "tokens_per_second": sum(r["generated_tokens"] for r in rows) / max(seconds, 1e-9),
        "seconds_per_sample": seconds / n,
        "compile_seconds": sum(r["compile_seconds"] or 0.0 for r in rows),
        "truncated": sum(r["fewshot_dropped"] > 0 for r in rows),  # prompts that lost few-shot examples
    }


def print_table(summary: dict) -> None:
    names_ = list(summary)
    same_key = next((k for s in summary.values() for k in s if k.startswith("identical_to_")), None)
    width = max(16, max(map(len, names_)) + 2)
    print(f"\n{'strategy':<{width}}{'strict':>8}{'flexible':>10}{'mean NFE':>10}{'NFE ratio':>11}{'speedup':>9}"
          f"{'tok/s':>9}{'s/sample':>10}{'compile s':>11}{'n':>6}" + (f"{'same':>7}" if same_key else ""))
    for name in names_:
        s = summary[name]
        same = f"{s[same_key]:>7.2f}" if same_key and same_key in s else ("      -" if same_key else "")
        print(f"{name:<{width}}{s['accuracy_strict']:>8.3f}{s['accuracy_flexible']:>10.3f}{s['mean_nfe']:>10.1f}"
              f"{s['nfe_ratio']:>11.3f}{s['speedup']:>8.2f}x{s['tokens_per_second']:>9.1f}"
              f"{s['seconds_per_sample']:>10.4f}{s['compile_seconds']:>11.1f}{s['n']:>6}{same}")


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` whole: an interrupted write never leaves a torn file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def termination_as_interrupt():
    """SIGTERM (a scheduler's kill, `timeout`) ends the run like Ctrl-C: what is done is kept."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        join_processes(args)  # first thing: nothing may touch a JAX backend before the processes are joined
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    from localleap_jax import multihost

    if multihost.is_follower():
        from localleap_jax.lm_eval_adapter import follow
        return follow(compile_cache=not args.no_compile_cache)  # runs the leader's generations; writes nothing
    progress = Progress()
    try:
        with termination_as_interrupt(), multihost.leading():  # the followers are released however this ends
            return run(args, progress)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # the environment, not the code: a full disk, a vanished directory
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        progress.flush()
        print(progress.interrupted(str(e) or "Ctrl-C"), file=sys.stderr)
        return EXIT_INTERRUPTED
    except multihost.LostProcessError as e:
        progress.flush()
        multihost.exit_lost(f"{e}; {progress.kept()}")


def join_processes(args) -> None:
    """Join the other processes (--coordinator ...; nothing for one process), then build the --mesh over
    every device of every process (args.device_mesh; None: the single-process pmap path)."""
    from localleap_jax import multihost
    from localleap_jax.decode import DecodeError

    try:
        multihost.initialize(multihost.processes_from(args.coordinator, args.num_processes, args.process_id))
    except multihost.DistributedError as e:
        raise UserError(str(e)) from None
    try:
        args.device_mesh = multihost.mesh_for_run(args.mesh)
    except DecodeError as e:
        raise UserError(f"--{e}") from None
    args.mesh_shape = None if args.device_mesh is None else dict(args.device_mesh.shape)


def find_checkpoint(args) -> tuple[Path, dict]:
    """(checkpoint directory, its manifest) for --checkpoint/--model; checkpoint problems are user errors."""
    import localleap_jax as ll
    from localleap_jax.checkpoint import read_manifest, resolve_checkpoint

    try:
        path = resolve_checkpoint(args.model or args.checkpoint)
        return path, read_manifest(path)
    except (ll.CheckpointError, ll.ConfigError) as e:
        raise UserError(str(e)) from None


def check_settings(args, manifest: dict) -> None:
    """Fill the model's defaults into unset flags and check the decoding settings together."""
    from localleap_jax.decode import DecodeError

    defaults = {**DEFAULTS, **manifest.get("eval_defaults", {})}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for strategy in args.strategies:
        try:
            decode_config(strategy, args.caches[0], args).validate()
        except DecodeError as e:
            raise UserError(f"--strategies {strategy}: {e}") from None


@contextmanager
def holding(out: Path, progress: Progress):
    """Hold OUT for this run (a second run into it is refused); on the way out let go of it, and remove it
    if the run produced nothing (an error or Ctrl-C before the first answer leaves nothing behind)."""
    claim = OutputDir(out)
    note = claim.claim()
    if note:
        print(f"note: {note}", file=sys.stderr)
    progress.out = out
    finished = False
    try:
        yield
        finished = True
    finally:
        claim.release()
        if not finished and progress.answers == 0:
            claim.discard()
            progress.discarded = claim.created is not None


def run(args, progress: Progress) -> int:
    import localleap_jax as ll

    # Everything that can be checked cheaply is checked before anything is created or loaded.
    if args.output:
        check_output(Path(args.output).expanduser().resolve())
    path, manifest = find_checkpoint(args)
    check_settings(args, manifest)
    check_gen_length(args, path)
    plan = plan_data(args, manifest)
    out = Path(args.output or REPO / "runs" / "eval_gsm8k" / path.name).expanduser().resolve()
    check_output(out)

    with holding(out, progress):  # held from here on, so a second run is refused before it loads anything
        model = load_model(path, args)
        task, include, data_id = write_task(plan, out)
        print(f"model {path} ({model.config.num_params / 1e6:.1f}M params, {model.dtype}); data: {plan.description}; "
              f"{args.num_fewshot}-shot, gen {args.gen_length}, block {args.block_length}, cache {args.cache}; "
              f"output {out}")
        summary, samples = evaluate_all(model, args, task, include, data_id, out, progress)
        write_results(out, summary, samples, config_record(args, path, model, plan, task))
    print_table(summary)
    print(f"\nwrote {out / 'samples.jsonl'} and {out / 'summary.json'}")
    if path.resolve() == ll.checkpoint.EMBEDDED.resolve():
        print(LLADA_HINT)
    return 0


def check_gen_length(args, path: Path) -> None:
    """--gen-length against the model's length, from config.json (before loading the weights)."""
    from localleap_jax.config import ConfigError, ModelConfig

    try:
        limit = ModelConfig.from_json_file(path / "config.json").max_sequence_length
    except ConfigError as e:
        raise UserError(f"{path}: {e}") from None
    if args.gen_length >= limit:
        raise UserError(f"--gen-length {args.gen_length} leaves no room for a prompt: the model's "
                        f"max_sequence_length is {limit}")


def load_model(path: Path, args):
    import localleap_jax as ll
    from localleap_jax.lm_eval_adapter import default_dtype

    from localleap_jax import multihost

    try:  # on every process at once when there are several
        return multihost.leader().load(path, dtype=default_dtype() if args.dtype == "auto" else args.dtype,
                                       mesh=args.device_mesh)
    except (ll.CheckpointError, ll.ConfigError) as e:
        raise UserError(str(e)) from None


def evaluate_all(model, args, task, include, data_id, out, progress) -> tuple[dict, list[dict]]:
    summary, all_rows, texts = {}, [], {}
    for cache_mode in args.caches:
        for strategy in args.strategies:
            name = strategy if len(args.caches) == 1 else f"{strategy}+{cache_mode}"
            t0 = time.time()
            lm, samples, batches = run_strategy(model, strategy, cache_mode, args, task, include, data_id, out,
                                                progress)
            rows = collect(name, lm, samples)
            all_rows += rows
            summary[name] = summarize(rows)
            texts[strategy, cache_mode] = [r["generated"] for r in rows]
            if cache_mode != args.caches[0]:  # how often the cached approximation changed nothing
                same = [a == b for a, b in zip(texts[strategy, cache_mode], texts[strategy, args.caches[0]])]
                summary[name][f"identical_to_{args.caches[0]}"] = sum(same) / len(same)
            truncated = f", {summary[name]['truncated']} prompts lost few-shot examples" if summary[name]["truncated"] else ""
            print(f"{name}: {summary[name]['accuracy_strict']:.3f} strict, mean NFE "
                  f"{summary[name]['mean_nfe']:.1f} ({batches} batches generated, {time.time() - t0:.0f}s{truncated})")
    first = next(iter(summary.values()))
    for s in summary.values():
        s["nfe_ratio"] = s["mean_nfe"] / max(first["mean_nfe"], 1e-9)
        s["speedup"] = first["seconds_per_sample"] / max(s["seconds_per_sample"], 1e-9)
    return summary, all_rows


def config_record(args, path: Path, model, plan: DataPlan, task: str) -> dict:
    return {"checkpoint": str(path), "dtype": str(model.dtype), "data": plan.description, "task": task,
            "num_fewshot": args.num_fewshot,
            "truncate_fewshot": args.truncate_fewshot, "gen_length": args.gen_length,
            "block_length": args.block_length, "steps": args.steps, "kappa": args.kappa, "tau": args.tau,
            "radius": args.radius, "cache": args.cache, "early_stop": args.early_stop, "limit": args.limit,
            "batch_size": args.batch_size, "seed": args.seed, "mesh": args.mesh_shape,
            "processes": _process_count()}


def _process_count() -> int:
    from localleap_jax import multihost
    return multihost.process_count() if multihost.is_multiprocess() else 1


def write_results(out: Path, summary: dict, rows: list[dict], config: dict) -> None:
    write_atomically(out / "samples.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    write_atomically(out / "summary.json", json.dumps({"strategies": summary, "config": config}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
