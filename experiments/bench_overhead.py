"""What the decode loop costs beyond its forward passes, per cache mode, measured side by side in one run.

    python experiments/bench_overhead.py                          # small shape, B=1, P=128, G=64, T=16, 1 thread
    python experiments/bench_overhead.py --batch 8 --prompt-length 512 --gen-length 256 --block-length 32

The floor is a compiled `fori_loop` of the same passes with nothing else: each cache policy's own forward (a
full refresh at every block's first pass, its cached window otherwise: the same mix of passes the decode runs),
the LM head on the block and the prediction (softmax, argmax, confidence). The loop is `ll.generate` with
low_confidence pinned at --tokens-per-step (so both run the same number of passes per block), which adds the
rule (its selection), the commit scatter, block bookkeeping, the stop policy and NFE counting. Both are timed
interleaved (--reps rounds, median), one CPU thread by default (--threads 0: all).
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_threads import N_THREADS  # noqa: F401 (before jax: it sets XLA's threads)

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import random_model
from localleap_jax import cli


def floor_program(model, cfg, ids, mask):
    """ms/pass of the decode's forward passes alone (see the module docstring), as a jitted function of params."""
    from localleap_jax.decode import predict
    from localleap_jax.decode.canvas import Canvas

    loop = cfg.loop_settings(False, model.config)
    G, T = cfg.gen_length, cfg.block_length
    per_block = cfg.rule.steps // (G // T)
    special = model.special

    def run(denoiser, ids, mask):
        canvas = Canvas.build(ids, mask, gen_length=G, block_length=T, mask_id=special.mask, shift=denoiser.shift)
        done = jnp.zeros((canvas.batch,), bool)

        def body(i, carry):
            x, state, acc = carry
            b = jnp.full((canvas.batch,), i // per_block, jnp.int32)
            block = canvas.block(x, b)
            hidden = loop.cache.forward(denoiser, canvas, x, block, state, i % per_block == 0, False, done)
            pred, conf, _ = predict(denoiser.head(hidden.block), loop.scoring, special, None)
            # the canvas changes every pass, as the decode's does (a constant one would let XLA hoist the forward)
            x = x.at[:, canvas.prompt_length + i].set(pred[:, 0])
            return x, hidden.cache, acc + conf.sum()  # (used: nothing is dropped as dead code)
        init = (canvas.x0, loop.cache.init(denoiser, canvas), 0.0)
        return jax.lax.fori_loop(0, per_block * (G // T), body, init)[2]
    return jax.jit(run), per_block * (G // T)


def main(argv=None):
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=("small", "llada-8b"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=16)
    ap.add_argument("--tokens-per-step", type=int, default=4)
    ap.add_argument("--cache", default="none,prefix,dual")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (read by bench_threads)")
    args = ap.parse_args(argv)

    import localleap_jax as ll

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    model = random_model(args.shape, dtype)
    B, P, G, T = args.batch, args.prompt_length, args.gen_length, args.block_length
    ids = np.random.RandomState(B).randint(0, model.config.vocab_size - 1000, (B, P)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    print(f"{jax.devices()[0].device_kind}: {args.shape}, B={B}, prompt {P}, gen {G}, block {T}, "
          f"{args.tokens_per_step} tokens/pass, {N_THREADS} thread(s)")
    print(f"{'cache':<8}{'passes':>7}{'floor ms/pass':>15}{'loop ms/pass':>14}{'overhead':>10}")
    for cache in args.cache.split(","):
        cfg = ll.DecodeConfig(strategy=ll.rule("low_confidence", steps=G // args.tokens_per_step), gen_length=G,
                              block_length=T, cache=cache)
        floor, passes = floor_program(model, cfg, ids, mask)
        jax.block_until_ready(floor(model.denoiser, ids, mask))
        out = ll.generate(model, ids, mask, cfg)
        assert out.forward_passes == passes, (out.forward_passes, passes)  # the same passes on both sides
        floors, loops = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(floor(model.denoiser, ids, mask))
            floors.append((time.perf_counter() - t0) / passes * 1e3)
            out = ll.generate(model, ids, mask, cfg)
            loops.append(out.seconds / out.forward_passes * 1e3)
        f, lp = float(np.median(floors)), float(np.median(loops))
        print(f"{cache:<8}{passes:>7}{f:>15.2f}{lp:>14.2f}{lp / f - 1:>+10.1%}")


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
