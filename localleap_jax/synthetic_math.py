"""Deterministic GSM8K-format word problems for the small embedded model.

Each record is {"question", "answer"} with the arithmetic written out GSM8K-style
("Mia has 3 + 4 = <<3+4=7>>7 apples now.\\n#### 7"). The text around the numbers is
templated, so a model predicts it with confidence; the numbers must be copied from the
question or computed, so the model is unsure there. Parallel decoding has something to gain
(the template) and something to lose (committing a number before it is settled).

Kinds: `copy` (repeat a number from the question), `add` and `sub` (one step on single-digit
operands). The split is a function of the question text (a stable hash), so train and test
never share a question, whatever seed produced them. A leaf: it imports nothing of the package
(the command line is `python experiments/synthetic_math.py --split test --n 500 --out test.jsonl`).
"""

from __future__ import annotations

import hashlib
import json
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


def problems(split: str, seed: int) -> Iterator[dict]:
    """An endless, deterministic stream of problems of one split ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    while True:
        p = make_problem(rng)
        if _is_test(p["question"]) == (split == "test"):
            yield p


def take(split: str, n: int, seed: int = 0, unique: bool = True) -> list[dict]:
    if n < 1:
        raise ValueError(f"take {n} problems: n must be at least 1")
    out, seen = [], set()
    for p in problems(split, seed):
        if unique and p["question"] in seen:
            continue
        seen.add(p["question"])
        out.append(p)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


def write_jsonl(records: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
