"""The problems of an evaluation: where they and the few-shot examples come from (checked before anything
is written), and the lm-eval task that reads them (the stock gsm8k task on local files, or on the hub)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from localleap_jax import synthetic_math
from localleap_jax.errors import UserError
from localleap_jax.hashing import sha256_files


NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def unscorable(row: dict, scored: bool = True) -> str | None:
    """Why lm-eval's gsm8k task cannot score this row (its target is what follows the last '####' of the answer,
    compared with ',' and '$' and a final '.' taken away), or None when it can."""
    question, answer = row["question"], row["answer"]
    if not isinstance(question, str) or not question.strip():
        return f"its question is {'empty' if isinstance(question, str) else type(question).__name__}, not text"
    if not scored:
        return None
    if not isinstance(answer, str):
        return f"its answer is {type(answer).__name__}, not text"
    if "####" not in answer:
        return "its answer has no '#### N' (the gold number the scorer reads)"
    target = answer.split("####")[-1].strip()
    if not NUMBER.fullmatch(re.sub(r"[,$]", "", target).rstrip(".")):
        return f"its gold '#### {target[:30]}' is not a number"
    return None


def read_gsm8k_jsonl(path: Path, flag: str = "--data", scored: bool = True) -> list[dict]:
    """The problems of a GSM8K-format JSONL file; refused in one line for a line that is not JSON or lacks the keys,
    and for rows whose question is not text or (`scored`: the answers are scored) whose gold answer lm-eval's
    scorer cannot read, all of them counted, the first named."""
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
        rows.append((n, row))
    if not rows:
        raise UserError(f"{flag} {path} holds no problems")
    bad = [(n, why) for n, row in rows for why in [unscorable(row, scored)] if why]
    if bad:
        n, why = bad[0]
        more = f"; lines {', '.join(str(m) for m, _ in bad[1:6])}{', ...' if len(bad) > 6 else ''} too" if bad[1:] else ""
        raise UserError(f"{flag} {path}: {len(bad)} of {len(rows)} problems cannot be used (line {n}: {why}{more}); "
                        "fix or remove them")
    return [row for _, row in rows]


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """Where the problems and few-shot examples come from, checked before anything is written."""

    description: str
    test: Path | None = None  # a GSM8K-format file (None: synthetic or the hub)
    fewshot: Path | None = None
    synthetic: dict | None = None  # the embedded model's split spec, written into OUT/data


def plan_data(data: str | None, fewshot_data: str | None, num_fewshot: int, manifest: dict) -> DataPlan:
    """The plan for --data and --fewshot-data (None: not given) with `num_fewshot` examples per problem:
    the files given, else the checkpoint's own evaluation split (its manifest says), else the hub."""
    if data:
        test = Path(data).expanduser().resolve()
        n_test = len(read_gsm8k_jsonl(test))
        if fewshot_data:
            fewshot = Path(fewshot_data).expanduser().resolve()
            n_fewshot = len(read_gsm8k_jsonl(fewshot, "--fewshot-data"))
        else:
            beside = test.with_name("train.jsonl")
            fewshot = beside if beside.is_file() and beside != test else test
            n_fewshot = n_test if fewshot == test else len(read_gsm8k_jsonl(fewshot, "--fewshot-data"))
        available = n_fewshot - (fewshot == test)  # a problem never serves as its own example
        if num_fewshot > available:
            raise UserError(f"--num-fewshot {num_fewshot}: {fewshot} offers only {available} few-shot "
                            f"examples per problem")
        return DataPlan(str(test), test=test, fewshot=fewshot)
    if manifest.get("eval_data") == "synthetic_math":
        spec = manifest.get("eval_data_spec", {"n": 500, "seed": 0})
        if num_fewshot > 50:
            raise UserError(f"--num-fewshot {num_fewshot}: the synthetic few-shot split holds 50 examples")
        task = spec.get("task", "math")
        name = "synthetic_math" if task == "math" else f"synthetic_math {task}"
        return DataPlan(f"{name} test split ({spec['n']} held-out problems, seed {spec['seed']})", synthetic=spec)
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


@dataclasses.dataclass(frozen=True)
class Task:
    """The lm-eval task an evaluation runs, as `write_task` made it ready."""

    name: str  # lm-eval's name for it
    include: Path | None  # the directory holding its yaml (None: a stock task of lm-eval's own index)
    data_id: str  # identity of the data's content: the answers depend on what the files hold, not where


def write_task(plan: DataPlan, out: Path) -> Task:
    """The lm-eval task of a checked plan (the synthetic split is written into OUT/data first)."""
    if plan.synthetic is not None:
        data = out / "data"
        data.mkdir(parents=True, exist_ok=True)
        spec = plan.synthetic
        synthetic_math.write_jsonl(synthetic_math.split_of(spec)[0], str(data / "test.jsonl"))
        synthetic_math.write_jsonl(synthetic_math.split_of(spec, "train", 50)[0], str(data / "train.jsonl"))
        test, fewshot = data / "test.jsonl", data / "train.jsonl"
    elif plan.test is not None:
        test, fewshot = plan.test, plan.fewshot
    else:
        return Task("gsm8k", None, "hub:openai/gsm8k")
    name, include = local_task(out, test, fewshot)
    return Task(name, include, sha256_files([test, fewshot]))
