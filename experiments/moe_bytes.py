"""The MoE layer's bytes against its floor, counted from the compiled program (no run, no weights allocated).

    python experiments/moe_bytes.py                                  # LLaDA2.0-mini's layer, fp32, this host
    JAX_PLATFORMS=cpu python experiments/moe_bytes.py --topology v6e:2x2 --dtype bfloat16   # a TPU chip (libtpu)
    python experiments/moe_bytes.py --tokens 32,1152 --dispatches capacity,ragged,tiles,gmm,all --json out.json

For each token count and dispatch (localleap_jax.moe), `moe_layer` is lowered from shapes and compiled, and its bytes
counted by localleap_jax.hlo_bytes (data-dependent conditionals at their cheapest branch: capacity's overflow path
not taken, as with an evenly loaded router). The floor: the router's and shared expert's weights, and the routed
experts a batch touches, read once, plus the tokens in and out. Touched experts are what a uniform router chooses on
average, E (1 - (1 - k/E)^T) (a trained, load-balanced router is close to it): at LLaDA2.0-mini's shape (256
experts, top 8) 163 of 256 for a 32-token block, all 256 for a 1152-token canvas. A Pallas kernel (gmm) is a custom
call whose operands are counted whole: its row of the table is the bytes of its operands, an upper bound (the
kernel loads only the experts that have rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "mini": dict(hidden=2048, experts=256, width=512, top_k=8, n_group=8, topk_group=4, shared=1, scale=2.5),
    "small": dict(hidden=256, experts=32, width=64, top_k=4, n_group=4, topk_group=2, shared=1, scale=2.5),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="mini")
    p.add_argument("--tokens", default="32,1152")
    p.add_argument("--dispatches", default="capacity,ragged,tiles,gmm,all")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--topology", default=None, help="a TPU topology (one chip of it): v6e:2x2, v5e:2x4, ...")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from localleap_jax import hlo_bytes
    from localleap_jax.attention import lowering_platform
    from localleap_jax.dist.aot import topology_devices
    from localleap_jax.moe import MoE, Router, moe_layer

    shape = SHAPES[args.shape]
    D, E, F, k = shape["hidden"], shape["experts"], shape["width"], shape["top_k"]
    S = F * shape["shared"]
    dtype = jnp.dtype(args.dtype)
    size = dtype.itemsize
    device = topology_devices(args.topology)[0] if args.topology else None
    on = None if device is None else jax.sharding.SingleDeviceSharding(device)
    sds = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt, sharding=on)  # noqa: E731
    params = {"gate": {"kernel": sds(D, E)}, "expert_bias": sds(E, dt=jnp.float32),
              "experts": {"gate_proj": sds(E, D, F), "up_proj": sds(E, D, F), "down_proj": sds(E, F, D)},
              "shared": {n: {"kernel": sds(*s)} for n, s in (("gate_proj", (D, S)), ("up_proj", (D, S)),
                                                            ("down_proj", (S, D)))}}
    router = Router(E, k, "sigmoid", bias="select", n_group=shape["n_group"], topk_group=shape["topk_group"],
                    normalise=True, scale=shape["scale"])
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        touched = E * (1 - (1 - k / E) ** T)
        floor = (D * E * size + E * 4 + 3 * D * S * size + touched * 3 * D * F * size + 2 * T * D * size)
        for dispatch in args.dispatches.split(","):
            moe = MoE(router, dispatch=dispatch)
            with lowering_platform(device.platform if device is not None else None):
                lowered = jax.jit(lambda p, x: moe_layer(moe, p, x)).lower(params, sds(T, D))
            try:
                compiled = lowered.compile()
            except Exception as e:  # a kernel this backend cannot compile
                rows.append(dict(tokens=T, dispatch=dispatch, error=str(e).splitlines()[0][:120]))
                print(f"T={T:5d} {dispatch:9s} cannot compile: {rows[-1]['error']}", flush=True)
                continue
            moved = hlo_bytes.parse(compiled.as_text()).cost().total(hlo_bytes.CHEAPEST)
            rows.append(dict(tokens=T, dispatch=dispatch, bytes=moved, floor=round(floor), touched=round(touched, 1),
                             ratio=round(moved / floor, 3)))
            print(f"T={T:5d} {dispatch:9s} {moved / 1e6:10.1f} MB  floor {floor / 1e6:9.1f} MB ({touched:.0f} of {E} "
                  f"experts)  {moved / floor:6.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(shape=args.shape, dtype=args.dtype, topology=args.topology,
                                                   rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
