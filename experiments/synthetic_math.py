"""Deterministic GSM8K-format word problems for the small embedded model, written to a JSONL file.

    python experiments/synthetic_math.py --split test --n 500 --out test.jsonl

The problems and their split are `localleap_jax.synthetic_math` (the evaluation's data plan needs them
too); its names are kept here for the scripts and tests that import this module.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localleap_jax.synthetic_math import (ITEMS, KINDS, NAMES, TASKS, TEST_FRACTION, make_problem, problems,  # noqa: E402
                                          take, write_jsonl)

__all__ = ["ITEMS", "KINDS", "NAMES", "TASKS", "TEST_FRACTION", "make_problem", "problems", "take", "write_jsonl"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("train", "test"), default="test")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    write_jsonl(take(args.split, args.n, args.seed), args.out)


if __name__ == "__main__":
    main()
