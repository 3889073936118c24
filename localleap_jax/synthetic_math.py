"""Deterministic GSM8K-format word problems for the small embedded model.

Each record is {"question", "answer"} with the arithmetic written out GSM8K-style
("Mia has 3 + 4 = <<3+4=7>>7 apples now.\\n#### 7"). The text around the numbers is
templated, so a model predicts it with confidence; the numbers must be copied from the
question or computed, so the model is unsure there. Parallel decoding has something to gain
(the template) and something to lose (committing a number before it is settled).

Four tasks. `math` (the embedded tiny-math model's): kinds `copy` (repeat a number from the question),
`add` and `sub` (one step on single-digit operands); every token is settled by the question, so
committing many at once costs little. `chain` (`train_tiny.py --task chain`): two to four assignments of +, -
and doubling on values that stay in 1..9 ("a = 3. b = a *2. c = b - 4. What is c?"), each worked out in
turn ("b = 3 *2 = 6. c = 6 - 4 = 2."), so a step's result is easy once the step before it is written and
hard from the question alone; committing a result before the one it builds on is where parallel decoding
loses. `chain3` and `chain6`: the same with exactly three / six steps (the
embedded tiny-chain model's training stages; it answers chain6).

The split is a function of the question text (a stable hash), so train and test
never share a question, whatever seed produced them. A leaf: it imports nothing of the package
(the command line is `python experiments/synthetic_math.py --split test --n 500 --out test.jsonl`).
"""

from __future__ import annotations

import hashlib
import json
import operator
import random
from typing import Iterator

NAMES = [("Mia", "She"), ("Tom", "He"), ("Ava", "She"), ("Leo", "He"), ("Zoe", "She"), ("Sam", "He"),
         ("Ivy", "She"), ("Ben", "He"), ("Amy", "She"), ("Max", "He"), ("Eva", "She"), ("Dan", "He"),
         ("Lily", "She"), ("Jack", "He"), ("Emma", "She"), ("Noah", "He"), ("Rosa", "She"), ("Omar", "He")]
ITEMS = ["apples", "pens", "books", "cards", "shells", "coins", "eggs", "cups", "hats", "kites", "rocks",
         "stamps", "toys", "bags", "cakes", "fish", "balls", "bikes"]
KINDS = ("copy", "add", "sub")
TEST_FRACTION = 0.1


def _is_test(question: str) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:4], "little") < TEST_FRACTION * 2**32


def make_problem(rng: random.Random) -> dict:
    (name, pron), friend = rng.sample(NAMES, 2)
    item, other = rng.sample(ITEMS, 2)
    kind = rng.choice(KINDS)
    if kind == "copy":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if rng.random() < 0.5:
            q = f"{name} has {a} {item} and {b} {other}. How many {other} does {name} have?"
            ans, n, what = b, b, other
        else:
            q = f"{name} has {a} {item} and {b} {other}. How many {item} does {name} have?"
            ans, n, what = a, a, item
        answer = f"{name} has {n} {what}.\n#### {ans}"
    elif kind == "add":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        c = a + b
        q = f"{name} has {a} {item}. {pron} gets {b} more {item}. How many {item} does {name} have now?"
        answer = f"{name} has {a} + {b} = <<{a}+{b}={c}>>{c} {item} now.\n#### {c}"
    else:
        a = rng.randint(2, 9)
        b = rng.randint(1, a - 1)
        c = a - b
        q = f"{name} has {a} {item}. {pron} gives {b} {item} to {friend[0]}. How many {item} does {name} have left?"
        answer = f"{name} has {a} - {b} = <<{a}-{b}={c}>>{c} {item} left.\n#### {c}"
    return {"question": q, "answer": answer, "kind": kind}


# Totals stay one digit, so every number is one token (with totals up to 20 a one-token-per-step decode
# committed the "1" of a two-digit result where a one-digit one belonged, and scored 7%).
MAX_TOTAL = 9


LETTERS = "abcdefg"
MAX_OPERAND = MAX_TOTAL - 1  # of + and -
DOUBLING_SHARE = 1 / 3  # of the steps whose value can double
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _operation(op: str, b: int) -> str:
    """A step's operator and operand as written: ` + 3`, ` - 3`, ` *2`. The tokenizer has `Ġ+` and `Ġ-` but
    no `Ġ*`, so ` * 2` is one token longer; with it a worked answer's length, and so where its `####` line
    falls, depended on how many doublings it held, and 66 of the 109 problems LocalLeap missed (one token per
    pass solved them) had every step right and the answer line misplaced. Written ` *2`, every step of a
    chain is the same number of tokens."""
    return " *2" if op == "*" else f" {op} {b}"


def make_chain_problem(rng: random.Random, steps: tuple[int, int] = (2, 4)) -> dict:
    """A chain of `steps` (low, high: inclusive) assignments on values in 1..MAX_TOTAL (`a = 3. b = a + 2.
    c = b - 1. What is c?`), each worked out in turn (`b = 3 + 2 = 5. c = 5 - 1 = 4.`, with every value kept
    to one digit). A step names the value it builds on, so once the step before it is written it is a lookup
    and one operation; from the question alone it needs every step before it."""
    total = rng.randint(1, MAX_TOTAL)
    said, worked = [f"a = {total}."], []
    for i in range(rng.randint(*steps)):
        prev, name = LETTERS[i], LETTERS[i + 1]
        # The operand of + and - is drawn before which of them (one that keeps the value in 1..MAX_TOTAL), and
        # a doubling takes a fixed share of the steps that can double: a step's operator and operand then say
        # little about its result. Drawn the other way round (the operator, then an operand that fits), ` + 1`
        # came mostly from an 8 (P(result 9 | + 1) = 0.48), and a model that could not yet work a step out
        # guessed 9 from the operator alone, and was sure of it; drawing every operator after the operand made
        # doubling half of the steps from small values, with the same effect on ` *2`.
        if 2 * total <= MAX_TOTAL and rng.random() < DOUBLING_SHARE:
            op, b = "*", 2
        else:
            ops = []
            while not ops:  # an operand neither + nor - can take with this total is drawn again
                b = rng.randint(1, MAX_OPERAND)
                ops = ["+"] * (total + b <= MAX_TOTAL) + ["-"] * (total - b >= 1)
            op = rng.choice(ops)
        step, value = _operation(op, b), OPS[op](total, b)
        said.append(f"{name} = {prev}{step}.")
        worked.append(f"{name} = {total}{step} = {value}.")
        total = value
    q = " ".join(said) + f" What is {name}?"
    return {"question": q, "answer": " ".join(worked) + f"\n#### {total}", "kind": f"chain{len(worked)}"}


def make_chain3_problem(rng: random.Random) -> dict:
    """A chain of exactly three assignments: every worked answer has the same words, only its values and
    operators (which the question gives) differ."""
    return make_chain_problem(rng, steps=(3, 3))


def make_chain6_problem(rng: random.Random) -> dict:
    """A chain of exactly six assignments (the embedded tiny-chain model's): one shape, as chain3's, with more
    steps than the small model works out from the question alone."""
    return make_chain_problem(rng, steps=(6, 6))


TASKS = {"math": make_problem, "chain": make_chain_problem, "chain3": make_chain3_problem,
         "chain6": make_chain6_problem}


def problems(split: str, seed: int, task: str = "math") -> Iterator[dict]:
    """An endless, deterministic stream of problems of one split ("train" or "test") of a task (TASKS)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    # The math task's streams are what they always were (its shipped model and its tests rely on them).
    rng = random.Random(f"{split}-{seed}" if task == "math" else f"{task}-{split}-{seed}")
    make = TASKS[task]
    while True:
        p = make(rng)
        if _is_test(p["question"]) == (split == "test"):
            yield p


def take(split: str, n: int, seed: int = 0, unique: bool = True, task: str = "math") -> list[dict]:
    if n < 1:
        raise ValueError(f"take {n} problems: n must be at least 1")
    out, seen, repeats = [], set(), 0
    for p in problems(split, seed, task):
        if unique and p["question"] in seen:
            repeats += 1
            if repeats > 100 * n + 10_000:  # a small task's split has fewer distinct questions than asked for
                raise ValueError(f"the {task} task's {split} split has only about {len(out)} distinct problems; "
                                 f"asked for {n}")
            continue
        seen.add(p["question"])
        out.append(p)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


def split_of(spec: dict, split: str = "test", n: int | None = None) -> tuple[list[dict], str]:
    """The problems a manifest's `eval_data_spec` ({"n", "seed"[, "task"]}) names, and a line describing them."""
    task, n = spec.get("task", "math"), spec["n"] if n is None else n
    name = "synthetic_math" if task == "math" else f"synthetic_math {task}"
    return take(split, n, spec["seed"], task=task), f"{name} {split} split ({n} held-out problems, seed {spec['seed']})"


def write_jsonl(records: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
