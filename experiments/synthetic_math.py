"""Deterministic GSM8K-format word problems for the small embedded models, written to a JSONL file.

    python experiments/synthetic_math.py --split test --n 500 --out test.jsonl
    python experiments/synthetic_math.py --task chain6 --split test --n 500 --out chain6-test.jsonl

The problems and their split are `localleap_jax.synthetic_math`; this is its command line.
"""

from __future__ import annotations

import argparse
import sys

from localleap_jax import cli
from localleap_jax.synthetic_math import TASKS, take, write_jsonl


def main(argv=None) -> int:
    ap = cli.OneLineParser(prog="python experiments/synthetic_math.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("train", "test"), default="test")
    ap.add_argument("--task", choices=tuple(TASKS), default="math", help="which problems (default math: tiny-math's)")
    ap.add_argument("--n", type=cli.positive, default=500)
    ap.add_argument("--seed", type=cli.seed, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return cli.run_command(lambda: write_jsonl(take(args.split, args.n, args.seed, task=args.task), args.out))


if __name__ == "__main__":
    sys.exit(main())
