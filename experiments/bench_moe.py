"""One MoE layer's time against a dense SwiGLU with the same active parameters, and against every expert on every
token: side by side, in one run.

    python experiments/bench_moe.py --small                 # CPU-sized: hidden 256, 32 experts of 64, top 4
    python experiments/bench_moe.py                         # LLaDA2.0-mini's layer (GPU: about a minute)
    python experiments/bench_moe.py --tokens 1152,32 --tiles 1,32,128 --json out.json

The layer (localleap_jax.moe) at LLaDA2.0-mini's shape: hidden 2048, 256 routed experts of width 512, top 8 of
8 groups / best 4, one shared expert of 512, sigmoid router with bias, renormalised and scaled; random weights
and inputs (a random router spreads tokens about evenly over the experts, as a trained, load-balanced one
does). For each token count (a 1152-token canvas, a 32-token block) it times:
  dense-active   a dense SwiGLU of width top_k * F + shared (the same active parameters per token)
  moe capacity   the layer as it runs by default: the routed experts' first C rows each in one batched matmul
                 (overflow, if any, through tiles); --capacities adds sizes
  moe ragged     the layer, routed experts as jax.lax.ragged_dot grouped matmuls
  moe tiles      the layer, routed experts as row tiles with gathered weights; --tiles adds sizes
  moe all        the layer, every expert on every token (masked by the routing weights)
  router         the router alone
and prints each time with its ratio to dense-active (the issue's goal: the layer <= 2x). Also printed: the
routed experts' weight bytes a token count touches (the experts chosen at least once) over dense-active's,
the floor of the ratio wherever reading weights dominates (small token counts).

Every variant is compiled and run once before timing; times are medians over --reps calls, each ending in
block_until_ready. On a backend whose ragged_dot lowering masks every group (JAX's generic lowering: CPU) it
costs E x the routed work, and is skipped when that would materialise more than --ragged-limit-gb.

Seen once on an H200 (jax 0.11.2, bf16, this script's defaults, 39 s in all), x dense-active: 1152 tokens:
capacity 3.6, tiles 8.4, all 11.5, ragged 68.5 (XLA masked it there), router alone 0.6; 32 tokens: capacity
5.2, tiles 6.2, all 12.2, ragged 10.5, router 1.1, where one lone call costs ~0.085 ms (dense-active 0.128).
With --skew (every token on the same 8 experts) capacity overflows: 13.3 at 1152 tokens, tiles 11.6.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from localleap_jax.moe import MoE, Router, default_capacity, default_tile, dense_mlp, moe_layer, route  # noqa: E402

SHAPES = {
    # LLaDA2.0-mini's MoE layer (../shared/reference/llada2-moe.md)
    "mini": dict(hidden=2048, experts=256, width=512, top_k=8, n_group=8, topk_group=4, shared=1, scale=2.5),
    # CPU-sized, the same proportions of choice (top 4 of 32, groups 4 / best 2)
    "small": dict(hidden=256, experts=32, width=64, top_k=4, n_group=4, topk_group=2, shared=1, scale=2.5),
}


def layer_params(shape: dict, dtype, seed: int = 0) -> dict:
    D, E, F, S = shape["hidden"], shape["experts"], shape["width"], shape["width"] * shape["shared"]
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    normal = lambda shape_, std: (jax.random.normal(next(keys), shape_, jnp.float32) * std).astype(dtype)  # noqa: E731
    return {"gate": {"kernel": normal((D, E), D ** -0.5)},
            "expert_bias": normal((E,), 0.01).astype(jnp.float32),
            "experts": {"gate_proj": normal((E, D, F), D ** -0.5), "up_proj": normal((E, D, F), D ** -0.5),
                        "down_proj": normal((E, F, D), F ** -0.5)},
            "shared": {"gate_proj": {"kernel": normal((D, S), D ** -0.5)},
                       "up_proj": {"kernel": normal((D, S), D ** -0.5)},
                       "down_proj": {"kernel": normal((S, D), S ** -0.5)}}}


def dense_params(shape: dict, dtype, seed: int = 1) -> dict:
    """A dense SwiGLU of width top_k * F + shared: the MoE layer's active parameters per token."""
    D, W = shape["hidden"], shape["width"] * (shape["top_k"] + shape["shared"])
    keys = jax.random.split(jax.random.key(seed), 3)
    kernel = lambda k, s: {"kernel": (jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(dtype)}  # noqa: E731
    return {"gate_proj": kernel(keys[0], (D, W)), "up_proj": kernel(keys[1], (D, W)),
            "down_proj": kernel(keys[2], (W, D))}


def median_seconds(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile and run once
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the CPU-sized shape instead of LLaDA2.0-mini's")
    ap.add_argument("--tokens", default="1152,32", help="token counts T (default %(default)s)")
    ap.add_argument("--tiles", default="", help="extra tile sizes to time for 'moe tiles' (e.g. 1,32,128)")
    ap.add_argument("--capacities", default="", help="extra capacities to time for 'moe capacity' (e.g. 48,96)")
    ap.add_argument("--dtype", default=None, help="bfloat16 on GPU, float32 on CPU by default")
    ap.add_argument("--skew", action="store_true", help="nearly identical tokens (one vector + 1%% noise), which "
                    "route alike: the worst case for per-expert capacity (dLLM canvases of mask tokens lean so)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ragged-limit-gb", type=float, default=4.0,
                    help="skip ragged_dot where its masking lowering would materialise more than this")
    ap.add_argument("--variants", default="", help="time only the variants starting with these (comma-separated; "
                    "dense-active always runs)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    wanted = [v for v in args.variants.split(",") if v]
    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("bfloat16" if backend == "gpu" else "float32"))
    name = "small" if args.small else "mini"
    shape = SHAPES[name]
    D, E, F, k = shape["hidden"], shape["experts"], shape["width"], shape["top_k"]
    router = Router(E, k, score="sigmoid", bias="select", n_group=shape["n_group"], topk_group=shape["topk_group"],
                    normalise=True, scale=shape["scale"])
    params, dense = layer_params(shape, dtype), dense_params(shape, dtype)
    masking_ragged = backend not in ("tpu", "gpu")  # JAX's generic lowering (a GPU may mask too: the times say)
    print(f"# {jax.devices()[0].device_kind} ({backend}), jax {jax.__version__}, {dtype}; shape {name}: hidden {D}, "
          f"{E} experts of {F}, top {k} (groups {shape['n_group']} / best {shape['topk_group']}), "
          f"shared {shape['shared']} x {F}; dense-active width {F * (k + shape['shared'])}"
          + ("; skewed tokens" if args.skew else ""))
    print(f"{'tokens':>6}  {'variant':<26} {'ms':>9}  {'x dense':>7}")
    results = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.key(T), (T, D), jnp.float32)
        x = (x[:1] + 0.01 * x if args.skew else x).astype(dtype)
        idx, _ = jax.jit(lambda p, x: route(router, x, p["gate"]["kernel"], p["expert_bias"]))(params, x)
        touched = len(np.unique(np.asarray(idx)))
        variants = {"dense-active": jax.jit(lambda p, x: dense_mlp("silu", p, x)),
                    "router": jax.jit(lambda p, x: route(router, x, p["gate"]["kernel"], p["expert_bias"]))}
        for capacity in [None] + [int(c) for c in args.capacities.split(",") if c]:
            label = f"moe capacity {capacity or default_capacity(T * k, E, T)}" + ("" if capacity else " (default)")
            variants[label] = jax.jit(lambda p, x, c=capacity: moe_layer(MoE(router, capacity=c), p, x))
        sizes = np.bincount(np.asarray(idx).reshape(-1), minlength=E)
        ragged_gb = E * T * k * max(D, F) * dtype.itemsize / 2 ** 30
        if not (masking_ragged and ragged_gb > args.ragged_limit_gb):
            variants["moe ragged"] = jax.jit(lambda p, x: moe_layer(MoE(router, dispatch="ragged"), p, x))
        tiles = [None] + [int(t) for t in args.tiles.split(",") if t]
        for tile in tiles:
            label = f"moe tiles {tile or default_tile(T * k, E)}" + ("" if tile else " (default)")
            variants[label] = jax.jit(lambda p, x, t=tile: moe_layer(MoE(router, dispatch="tiles", tile=t), p, x))
        variants["moe all"] = jax.jit(lambda p, x: moe_layer(MoE(router, dispatch="all"), p, x))
        variants = {label: fn for label, fn in variants.items()
                    if label == "dense-active" or not wanted or any(label.startswith(w) for w in wanted)}
        times = {}
        for label, fn in variants.items():
            p = dense if label == "dense-active" else params
            times[label] = median_seconds(lambda fn=fn, p=p: fn(p, x), args.reps)
        for label, seconds in times.items():
            ratio = seconds / times["dense-active"]
            print(f"{T:>6}  {label:<26} {seconds * 1e3:>9.3f}  {ratio:>7.2f}")
            results.append({"tokens": T, "variant": label, "seconds": seconds, "x_dense_active": ratio})
        if "moe ragged" not in times and masking_ragged and ragged_gb > args.ragged_limit_gb:
            print(f"{T:>6}  {'moe ragged':<26} {'skipped':>9}  (masking lowering: {ragged_gb:.1f} GB per matmul)")
        weight_floor = touched * 3 * D * F / (3 * D * F * (k + shape["shared"]))
        print(f"{T:>6}  experts touched {touched}/{E}: routed weight bytes read {weight_floor:.1f} x dense-active's; "
              f"rows per expert mean {sizes.mean():.1f}, max {sizes.max()}")
        results.append({"tokens": T, "experts_touched": touched, "weight_bytes_x_dense_active": weight_floor,
                        "rows_per_expert_max": int(sizes.max())})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": jax.devices()[0].device_kind, "backend": backend,
                                               "dtype": str(dtype), "shape": {name: shape}, "results": results},
                                              indent=1))


if __name__ == "__main__":
    from localleap_jax import cli

    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
