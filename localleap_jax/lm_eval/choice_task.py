"""An offline multiple-choice lm-eval task for the embedded model: the synthetic-math test split with the right
answer among wrong ones, scored by log-likelihood.

    python -m localleap_jax.lm_eval.choice_task OUT [--n 200] [--checkpoint embedded]
    python -m localleap_jax.lm_eval --model localleap --model_args checkpoint=embedded \\
        --include_path OUT/tasks --tasks synthetic_math_choice

Each item's context is the question as the model was trained on it (lm-eval's gsm8k prompt "Question: ...\nAnswer:"
as one chat turn, the assistant's header rendered into the text: likelihood requests are tokenized plainly) and its worked answer up to where the result is
first written ("Omar has 6 + 5 = <<6+5="); its four choices are the rest of the answer with the right result and
with three wrong ones (the result changed everywhere it appears: "11>>11 cards now.\n#### 11"), in an order fixed
by the item. Choosing the right one takes computing it: the text around the numbers is the same in every choice.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from localleap_jax import cli
from localleap_jax.synthetic_math import take

TASK = "synthetic_math_choice"


def choices_of(problem: dict, rng: random.Random) -> tuple[str, list[str], int]:
    """(the worked answer up to its result, four endings, index of the right one): the answer is cut where its
    result is first written, so every ending starts with a candidate result and repeats it where the answer does."""
    right = int(problem["answer"].rsplit("#### ", 1)[1])
    wrong = [d for d in range(max(right - 4, 0), right + 5) if d != right]
    rng.shuffle(wrong)
    values = [right, *wrong[:3]]
    rng.shuffle(values)
    worked, _ = problem["answer"].rsplit("\n#### ", 1)
    # the result follows the last "=" of "<<a+b=c>>c", or (a copy) the first " has "
    cut = worked.rindex("=") + 1 if "=" in worked else worked.index(" has ") + len(" has ")
    head, tail = worked[:cut], worked[cut:]
    endings = [tail.replace(str(right), str(v)) + f"\n#### {v}" for v in values]
    return head, endings, values.index(right)


def write_choice_task(out: str | Path, tokenizer, n: int = 200, seed: int = 0) -> tuple[str, Path]:
    """Write OUT/data/choice.jsonl and OUT/tasks/synthetic_math_choice.yaml; returns (task name, include path)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the choice task needs at least one item, got n={n!r}")
    out = Path(out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"choice-{seed}")
    rows = []
    for problem in take("test", n, seed=seed):
        head, endings, label = choices_of(problem, rng)
        prompt = f"Question: {problem['question']}\nAnswer:"  # lm-eval's gsm8k prompt, as the model was trained
        rows.append({"context": tokenizer.chat(prompt) + head, "choices": endings, "label": label,
                     "kind": problem["kind"]})
    data = out / "data" / "choice.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "tasks" / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    return TASK, out / "tasks"


def main(argv=None) -> int:
    ap = cli.OneLineParser(prog="python -m localleap_jax.lm_eval.choice_task", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory to write into (OUT/tasks is the --include_path)")
    ap.add_argument("--n", type=cli.positive, default=200, help="items (default 200)")
    ap.add_argument("--checkpoint", default="embedded", help="whose chat format the contexts use (default embedded)")
    args = ap.parse_args(argv)
    return cli.run_command(lambda: write(args))


def write(args) -> None:
    from localleap_jax.families import read_config_file
    from localleap_jax.resolve import resolve_checkpoint
    from localleap_jax.errors import UserError
    from localleap_jax.tokenizer import Tokenizer

    path = resolve_checkpoint(args.checkpoint)
    config = read_config_file(path / "config.json")
    tokenizer = Tokenizer.from_dir(path, mask_id=config.mask_token_id, eos_id=config.eos_token_id,
                                   pad_id=config.pad_token_id)
    try:
        name, include = write_choice_task(Path(args.out).expanduser().resolve(), tokenizer, args.n)
    except ValueError as e:  # too few problems, or a tokenizer the task cannot use
        raise UserError(str(e)) from None
    print(f"wrote the lm-eval task {name} ({args.n} items) into {include}: pass --include_path {include} "
          f"--tasks {name}")


if __name__ == "__main__":
    sys.exit(main())
