"""Forward latency and TFLOP/s: this Flax model next to transformers+PyTorch, same weights and shapes.

    python experiments/bench_forward.py                                   # CPU, small shape, fp32
    python experiments/bench_forward.py --shape llada-8b --length 1152 --batch 1,8 --dtype bfloat16   # GPU
    python experiments/bench_forward.py --shape dream-7b --length 1152 --batch 1,8 --dtype bfloat16   # GPU

Both sides run the full bidirectional forward to logits [B, L, V]; the printed ratio is
PyTorch time / JAX time (above 1: JAX is faster), measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench_common import forward_flops, median_seconds, on_gpu, random_model, torch_sync, torch_twin
from localleap_jax import cli

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None):
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=("small", "llada-8b", "dream-7b"),
                    help="random weights at this architecture (dream-7b: Dream's logits shift included)")
    ap.add_argument("--length", type=int, default=256, help="sequence length L (default %(default)s)")
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes (default %(default)s)")
    ap.add_argument("--dtype", default=None, help="bfloat16 on GPU, float32 on CPU by default")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true", help="JAX only")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu() else "float32"))

    from localleap_jax.model import forward

    model = random_model(args.shape, dtype)
    twin = None if args.no_torch else torch_twin(model)
    fwd = jax.jit(forward, static_argnames="config")
    rows = []
    print(f"{jax.devices()[0].device_kind}: shape {args.shape}, L={args.length}, {dtype.name}")
    print(f"{'B':>3} {'JAX ms':>9} {'JAX TFLOP/s':>12} {'torch ms':>9} {'torch TFLOP/s':>14} {'torch/JAX':>10}")
    for B in map(int, args.batch.split(",")):
        ids = np.random.RandomState(B).randint(0, model.config.vocab_size, (B, args.length)).astype(np.int32)
        mask = np.ones_like(ids, bool)
        ids_d, mask_d = jax.device_put(ids), jax.device_put(mask)
        jax_s = median_seconds(lambda: fwd(model.params, ids_d, mask_d, config=model.config).block_until_ready(),
                               reps=args.reps, warmup=2)
        flops = forward_flops(model.config, B, args.length)
        row = {"batch": B, "length": args.length, "jax_ms": jax_s * 1e3, "jax_tflops": flops / jax_s / 1e12}
        if twin is not None:
            import torch

            from oracles.bidirectional import bidirectional_logits
            tmodel, device = twin
            t_ids, t_mask = torch.tensor(ids, device=device), torch.tensor(mask, device=device)

            def run_torch():
                bidirectional_logits(tmodel, t_ids, t_mask)
                torch_sync()
            torch_s = median_seconds(run_torch, reps=args.reps, warmup=2)
            row |= {"torch_ms": torch_s * 1e3, "torch_tflops": flops / torch_s / 1e12, "torch_over_jax": torch_s / jax_s}
        rows.append(row)
        print(f"{B:>3} {row['jax_ms']:>9.2f} {row['jax_tflops']:>12.2f} {row.get('torch_ms', float('nan')):>9.2f} "
              f"{row.get('torch_tflops', float('nan')):>14.2f} {row.get('torch_over_jax', float('nan')):>9.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "shape": args.shape, "dtype": dtype.name, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
