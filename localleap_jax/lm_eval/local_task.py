"""Write an lm-eval task that reads GSM8K-format files from disk, for `--include_path` (no hub download).

    python -m localleap_jax.lm_eval.local_task OUT                                   # the embedded model's split
    python -m localleap_jax.lm_eval.local_task OUT --data ../shared/data/gsm8k/test.jsonl
    python -m localleap_jax.lm_eval --model localleap --model_args checkpoint=embedded \\
        --include_path OUT/tasks --tasks gsm8k_local --num_fewshot 0

The task is lm-eval's stock `gsm8k` (prompts, `Question:` stop, strict/flexible filters, exact match) with its
dataset pointed at the files: `--data FILE` (few-shot examples from train.jsonl beside it when there is one), or
by default the embedded model's held-out synthetic split (500 problems, seed 0, written into OUT/data).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from localleap_jax import cli
from localleap_jax.gsm8k import plan_data, write_task


def main(argv=None) -> int:
    ap = cli.OneLineParser(prog="python -m localleap_jax.lm_eval.local_task", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory to write into (OUT/tasks is the --include_path)")
    ap.add_argument("--data", help="a GSM8K-format JSONL file (question, answer); default: the synthetic split")
    args = ap.parse_args(argv)
    return cli.run_command(lambda: write(Path(args.out).expanduser().resolve(), args.data))


def write(out: Path, data: str | None) -> None:
    plan = plan_data(data, None, 0, {"eval_data": "synthetic_math", "eval_data_spec": {"n": 500, "seed": 0}})
    out.mkdir(parents=True, exist_ok=True)
    task = write_task(plan, out)
    print(f"wrote the lm-eval task {task.name} over {plan.description} into {task.include}: pass "
          f"--include_path {task.include} --tasks {task.name}")


if __name__ == "__main__":
    sys.exit(main())
