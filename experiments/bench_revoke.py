"""WINO (a rule that takes commits back) through the compiled JAX loop next to the authors' loop (`decoding_wino`,
transcribed eagerly in `oracles.revoke`: one forward pass of [canvas | masked copy of the block]
per step under WINO's 4D mask) on transformers' Llama holding the same random weights, side by side in one run.

    nice -n 10 .venv/bin/python experiments/bench_revoke.py           # `small` shape, ~1 min on 2 CPU cores
    .venv/bin/python experiments/bench_revoke.py --gen-length 128 --block-length 32 --prompts 4 --rules wino,saber

The head is scaled (--head-scale) so confidences spread over (0, 1) and WINO's narrow-out fires. Both sides decode
the same prompts one at a time (the authors' loop has batch 1), greedy, fp32; the tokens, NFE and remasks are
asserted equal before timing. Printed: seconds per prompt on each side and their ratio (JAX's compile apart),
NFE and remasks per prompt, and a batched JAX run (all prompts in one call) for scale.

Threads (--threads, default 1): the same count on both sides, set before torch and jax are imported.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_threads import N_THREADS  # noqa: E402 (before jax and torch: it sets their threads)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import localleap_jax as ll  # noqa: E402
from bench_common import random_model, torch_twin  # noqa: E402
from localleap_jax import cli  # noqa: E402
from oracles import revoke as reference_revoke  # noqa: E402
from localleap_jax.checkpoint import Model  # noqa: E402
from localleap_jax.tokenizer import left_pad  # noqa: E402

torch.set_num_threads(N_THREADS)


def sharpened(model: Model, scale: float) -> Model:
    params = dict(model.params)
    params["ff_out"] = {"kernel": model.params["ff_out"]["kernel"] * scale}
    return Model(model.config, params, tokenizer=None)


def authors(rule: str, fns, prompt, args, config):
    logits_fn, masked_fn = fns
    common = dict(mask_id=config.mask_token_id, gen_length=args.gen_length, predict_mask=False)
    if rule == "wino":
        return reference_revoke.wino_generate(masked_fn, prompt, block_length=args.block_length, **common)
    return reference_revoke.saber_generate(logits_fn, prompt, block_length=args.block_length, **common)


def main(argv=None) -> int:
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small")
    ap.add_argument("--rules", default="wino", help="wino and/or saber (comma-separated)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=16)
    ap.add_argument("--head-scale", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads on each side (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = sharpened(random_model(args.shape, "float32", args.seed), args.head_scale)
    twin, device = torch_twin(model)
    fns = (reference_revoke.logits_fn_from_model(twin), reference_revoke.masked_logits_fn_from_model(twin))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, model.config.vocab_size - 2, args.prompt_length).tolist() for _ in range(args.prompts)]
    print(f"shape {args.shape} (head x{args.head_scale:g}), fp32 on {jax.default_backend()}, {N_THREADS} thread(s); "
          f"{args.prompts} prompts of {args.prompt_length}, gen {args.gen_length}, block {args.block_length}")
    print(f"{'rule':8} {'authors s/prompt':>17} {'JAX s/prompt':>13} {'ratio':>7} {'NFE':>6} {'remasks':>8} "
          f"{'JAX batched s/prompt':>21}")
    for rule in [r.strip() for r in args.rules.split(",") if r.strip()]:
        cfg = ll.DecodeConfig(strategy=ll.rule(rule), gen_length=args.gen_length, block_length=args.block_length)
        one = [left_pad([p], model.config.pad_token_id) for p in prompts]
        ll.generate(model, *one[0], cfg)  # compile
        t0 = time.perf_counter()
        ours = [ll.generate(model, ids, mask, cfg) for ids, mask in one]
        jax_s = (time.perf_counter() - t0) / len(prompts)
        t0 = time.perf_counter()
        theirs = [authors(rule, fns, p, args, model.config) for p in prompts]
        torch_s = (time.perf_counter() - t0) / len(prompts)
        for o, t, p in zip(ours, theirs, prompts):
            assert o.tokens[0, o.prompt_length:].tolist() == t.tokens[len(p):], f"{rule}: tokens differ"
            assert int(o.nfe[0]) == t.nfe and int(o.remasks[0]) == t.remasks, f"{rule}: NFE or remasks differ"
        ids, mask = left_pad(prompts, model.config.pad_token_id)
        ll.generate(model, ids, mask, cfg)  # compile the batch shape
        t0 = time.perf_counter()
        ll.generate(model, ids, mask, cfg)
        batched = (time.perf_counter() - t0) / len(prompts)
        print(f"{rule:8} {torch_s:17.3f} {jax_s:13.3f} {torch_s / jax_s:6.2f}x {np.mean([t.nfe for t in theirs]):6.1f} "
              f"{np.mean([t.remasks for t in theirs]):8.1f} {batched:21.3f}")
    print("(tokens, NFE and remasks asserted equal on every prompt before the times were taken)")
    return 0


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
