"""Log-likelihood throughput: `ll.loglikelihood` (every Monte-Carlo mini-batch of a group of requests in one compiled
program) next to LLaDA's own loop (`eval_llada.py`'s get_loglikelihood, one request at a time, transcribed in
`oracles.likelihood`) on transformers' Llama holding the same random weights, side by side in one run.

    nice -n 10 .venv/bin/python experiments/bench_likelihood.py           # the `small` shape, ~1 min on 2 CPU cores
    .venv/bin/python experiments/bench_likelihood.py --requests 64 --mc-num 128 --mc-batch-size 32 --cfg 0.5

Requests look like a multiple-choice task's: contexts of 48..160 tokens, continuations of 1..12 (random ids, so
the numbers are throughput only). Both sides score every request with mc_num samples in mini-batches of
mc-batch-size rows, fp32. Printed: requests/s on each side and their ratio (JAX's compile time apart, after a
warm-up), and the programs an evaluation of these requests compiles (`compiled_programs()`). The PyTorch side runs
on --torch-requests of the requests (its time per request does not depend on the others).

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
from oracles import likelihood as reference_likelihood  # noqa: E402
from localleap_jax.compile_cache import compiled_programs  # noqa: E402
from oracles.bidirectional import bidirectional_logits  # noqa: E402

torch.set_num_threads(N_THREADS)


def main(argv=None) -> int:
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", help="bench_common shape (default small)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--torch-requests", type=int, default=8)
    ap.add_argument("--mc-num", type=int, default=64)
    ap.add_argument("--mc-batch-size", type=int, default=32)
    ap.add_argument("--cfg", type=float, default=0.0)
    ap.add_argument("--requests-per-call", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads on each side (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = random_model(args.shape, "float32", args.seed)
    twin, device = torch_twin(model)
    rng = np.random.default_rng(args.seed)
    V = model.config.vocab_size - 2  # never the mask or EOS ids
    contexts = [rng.integers(0, V, rng.integers(48, 161)).tolist() for _ in range(args.requests)]
    continuations = [rng.integers(0, V, rng.integers(1, 13)).tolist() for _ in range(args.requests)]
    lcfg = ll.LikelihoodConfig(mc_num=args.mc_num, batch_size=args.mc_batch_size, cfg_scale=args.cfg,
                               requests_per_call=args.requests_per_call)

    before = len(compiled_programs())
    t0 = time.perf_counter()
    ll.loglikelihood(model, contexts, continuations, lcfg)  # warm-up: compiles every group shape
    first = time.perf_counter() - t0
    programs = compiled_programs()[before:]
    t0 = time.perf_counter()
    ours = ll.loglikelihood(model, contexts, continuations, lcfg)
    jax_seconds = time.perf_counter() - t0

    def logits_fn(ids):
        return bidirectional_logits(twin, ids.to(device))

    n = min(args.torch_requests, args.requests)
    t0 = time.perf_counter()
    theirs = [reference_likelihood.llada_loglikelihood(logits_fn, c, y, mask_id=model.config.mask_token_id,
                                                       mc_num=args.mc_num, batch_size=args.mc_batch_size,
                                                       cfg=args.cfg, generator=torch.Generator().manual_seed(0))
              for c, y in zip(contexts[:n], continuations[:n])]
    torch_seconds = time.perf_counter() - t0

    jax_rate, torch_rate = args.requests / jax_seconds, n / torch_seconds
    print(f"shape {args.shape}, fp32 on {jax.default_backend()}, {N_THREADS} thread(s); mc_num {args.mc_num}, "
          f"mini-batch {args.mc_batch_size}, cfg {args.cfg}; {args.requests} requests "
          f"(context 48..160, continuation 1..12 tokens)")
    print(f"{'':28} {'requests/s':>11} {'s/request':>10}")
    print(f"{'LLaDA get_loglikelihood (torch)':28} {torch_rate:11.2f} {1 / torch_rate:10.3f}   ({n} requests)")
    print(f"{'ll.loglikelihood (JAX)':28} {jax_rate:11.2f} {1 / jax_rate:10.3f}   ({args.requests} requests)")
    print(f"ratio JAX / torch: {jax_rate / torch_rate:.2f}x")
    print(f"compiled programs for the evaluation: {len(programs)} ({first - jax_seconds:.1f} s of compile and "
          f"first run beyond a warm run); shapes (rows, canvas): "
          f"{sorted({tuple(p.shapes[0]) for p in programs})}")
    both = np.asarray(ours[:n]), np.asarray(theirs)
    print(f"estimates (different random draws, same estimator): JAX mean {both[0].mean():.2f}, torch mean "
          f"{both[1].mean():.2f} over the first {n}")
    return 0


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
