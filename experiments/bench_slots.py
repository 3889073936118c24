"""Continuous batching vs fixed batches: the same prompts, the same rule, side by side in one run.

    python experiments/bench_slots.py                                  # 64 prompts, 8 rows, early stop, embedded model
    python experiments/bench_slots.py --prompts 128 --rows 16 --cache none,dual --strategies localleap

A fixed batch lasts as long as its slowest row; `ll.generate(..., slots=S)` refills a finished row's slot with the
next prompt inside the compiled loop. Printed per strategy and cache mode: the forward passes (deterministic)
of N/S fixed batches of S rows vs one call of N prompts through S slots, their ratio, the slot occupancy (share of
row-passes that did work), wall time of each (compilation excluded: every program is run once first) and whether
every prompt's tokens are the same both ways.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from localleap_jax import cli


def main(argv=None):
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="N prompts (the synthetic-math test split)")
    ap.add_argument("--rows", type=int, default=8, help="S: rows of a fixed batch, and slots")
    ap.add_argument("--strategies", default="low_confidence,threshold,localleap")
    ap.add_argument("--cache", default="none,prefix,dual")
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=16)
    ap.add_argument("--no-early-stop", action="store_true", help="rows run to their last block (then slots gain "
                                                                 "only where rules commit at different rates)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.prompts % args.rows:
        ap.error(f"--prompts {args.prompts} must be a multiple of --rows {args.rows} (whole fixed batches)")

    import localleap_jax as ll
    from localleap_jax.synthetic_math import take

    model = ll.load(ll.checkpoint.EMBEDDED, dtype="float32")
    questions = [f"Question: {p['question']}\nAnswer:" for p in take("test", args.prompts, seed=1)]
    ids, mask = model.tokenizer.encode_batch(questions)  # one prompt bucket for both ways
    N, S = args.prompts, args.rows
    print(f"{N} prompts of the embedded model, {S} rows, gen {args.gen_length}, block {args.block_length}, "
          f"early stop {not args.no_early_stop}")
    print(f"{'strategy':<16}{'cache':<8}{'fixed passes':>13}{'slot passes':>12}{'ratio':>7}{'occupied':>16}"
          f"{'fixed s':>9}{'slots s':>9}{'speedup':>9}  same")
    rows = []
    for strategy in args.strategies.split(","):
        for cache in args.cache.split(","):
            cfg = ll.DecodeConfig(strategy=strategy, gen_length=args.gen_length, block_length=args.block_length,
                                  cache=cache, early_stop=not args.no_early_stop)

            def fixed():
                return [ll.generate(model, ids[i:i + S], mask[i:i + S], cfg) for i in range(0, N, S)]

            def slotted():
                return ll.generate(model, ids, mask, cfg, slots=S)

            fixed(), slotted()  # compile both programs first
            batches, through = fixed(), slotted()
            f_passes = sum(b.forward_passes for b in batches)
            f_seconds = sum(b.seconds for b in batches)
            f_occupied = sum(int(b.nfe.sum()) for b in batches) / (f_passes * S)
            same = bool(np.array_equal(np.concatenate([b.tokens for b in batches]), through.tokens))
            row = dict(strategy=strategy, cache=cache, prompts=N, rows=S, fixed_passes=f_passes,
                       slot_passes=through.forward_passes, fixed_occupancy=f_occupied,
                       slot_occupancy=through.occupancy, fixed_seconds=f_seconds, slot_seconds=through.seconds,
                       same_tokens=same, mean_nfe=float(through.nfe.mean()))
            rows.append(row)
            print(f"{strategy:<16}{cache:<8}{f_passes:>13}{through.forward_passes:>12}"
                  f"{through.forward_passes / f_passes:>7.2f}{f_occupied:>8.2f} -> {through.occupancy:.2f}"
                  f"{f_seconds:>9.2f}{through.seconds:>9.2f}{f_seconds / through.seconds:>8.2f}x  {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
