"""Continuous batching vs fixed batches: the same prompts, the same rule, side by side in one run.

    python experiments/bench_slots.py                                  # 64 prompts, 8 rows, early stop, embedded model
    python experiments/bench_slots.py --prompts 128 --rows 16 --cache none,dual --strategies localleap

A fixed batch lasts as long as its slowest row; `ll.generate(..., slots=S)` refills a finished row's slot with the
next prompt inside the compiled loop. Printed per strategy and cache policy: the forward passes (deterministic)
of N/S fixed batches of S rows vs one call of N prompts through S slots, their ratio, the passes that ran the whole
canvas for some row (a cache's refreshes, in lanes), the slot occupancy (share of row-passes that did work), wall
time of each (compilation excluded: every program is run once first; the best of --repeats interleaved runs), and
the process's CPU time over the same calls (XLA single-threaded by default, --threads: on a shared machine the
steadier measure of work), generated (non-EOS) tokens per wall second and per CPU second of each and their ratios,
and whether every prompt's tokens are the same both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench_threads import N_THREADS  # noqa: F401 (before jax: it sets XLA's CPU threads, --threads, default 1)
import numpy as np

from localleap_jax import cli


def main(argv=None):
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="N prompts (the synthetic-math test split)")
    ap.add_argument("--rows", type=int, default=8, help="S: rows of a fixed batch, and slots")
    ap.add_argument("--strategies", default="low_confidence,threshold,localleap")
    ap.add_argument("--cache", default="none,prefix,dual",
                    help="cache policies, comma-separated (a policy's settings: dkv:reload_every=4)")
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=16)
    ap.add_argument("--no-early-stop", action="store_true", help="rows run to their last block (then slots gain "
                                                                 "only where rules commit at different rates)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each way (the fastest is kept)")
    ap.add_argument("--threads", type=int, default=1, help="XLA CPU threads (read by bench_threads; 1: a shared "
                                                           "machine's steadiest timings)")
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
    print(f"{'strategy':<16}{'cache':<12}{'fixed passes':>13}{'slot passes':>12}{'ratio':>7}{'full':>10}"
          f"{'occupied':>16}{'fixed s':>9}{'slots s':>9}{'fixed tok/s':>12}{'slots tok/s':>12}{'speedup':>9}"
          f"{'fixed cpu':>10}{'slots cpu':>10}{'cpu ratio':>10}  same")
    rows = []
    for strategy in args.strategies.split(","):
        for cache in ll.rules.split_specs(args.cache):
            cfg = ll.DecodeConfig(strategy=strategy, gen_length=args.gen_length, block_length=args.block_length,
                                  cache=cache, early_stop=not args.no_early_stop)

            def fixed():
                return [ll.generate(model, ids[i:i + S], mask[i:i + S], cfg) for i in range(0, N, S)]

            def slotted():
                return ll.generate(model, ids, mask, cfg, slots=S)

            fixed(), slotted()  # compile both programs first
            f_seconds = s_seconds = f_cpu = s_cpu = float("inf")
            for _ in range(max(args.repeats, 1)):  # interleaved, the fastest of each kept
                c0 = time.process_time()
                batches = fixed()
                f_cpu = min(f_cpu, time.process_time() - c0)
                f_seconds = min(f_seconds, sum(b.seconds for b in batches))
                c0 = time.process_time()
                through = slotted()
                s_cpu = min(s_cpu, time.process_time() - c0)
                s_seconds = min(s_seconds, through.seconds)
            f_passes = sum(b.forward_passes for b in batches)
            f_full = sum(b.full_passes for b in batches)
            f_occupied = sum(int(b.nfe.sum()) for b in batches) / (f_passes * S)
            same = bool(np.array_equal(np.concatenate([b.tokens for b in batches]), through.tokens))
            generated = through.tokens[:, through.prompt_length:]
            tokens = int(np.sum(generated != model.config.eos_token_id))
            row = dict(strategy=strategy, cache=cache, prompts=N, rows=S, fixed_passes=f_passes,
                       slot_passes=through.forward_passes, fixed_full_passes=f_full, slot_full_passes=through.full_passes,
                       fixed_occupancy=f_occupied, slot_occupancy=through.occupancy, fixed_seconds=f_seconds,
                       slot_seconds=s_seconds, fixed_tokens_per_second=tokens / f_seconds,
                       slot_tokens_per_second=tokens / s_seconds, fixed_cpu_seconds=f_cpu, slot_cpu_seconds=s_cpu,
                       same_tokens=same, mean_nfe=float(through.nfe.mean()))
            rows.append(row)
            print(f"{strategy:<16}{cache:<12}{f_passes:>13}{through.forward_passes:>12}"
                  f"{f_passes / through.forward_passes:>6.2f}x{f_full:>5} {through.full_passes:>4}"
                  f"{f_occupied:>8.2f} -> {through.occupancy:.2f}"
                  f"{f_seconds:>9.2f}{s_seconds:>9.2f}{tokens / f_seconds:>12.0f}{tokens / s_seconds:>12.0f}"
                  f"{f_seconds / s_seconds:>8.2f}x{f_cpu:>10.2f}{s_cpu:>10.2f}{f_cpu / s_cpu:>9.2f}x  {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
