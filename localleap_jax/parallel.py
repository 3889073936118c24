"""Data-parallel generation over all local devices with `pmap`.

The batch is padded to a multiple of the device count (with copies of its first row, so every
padding row is a valid prompt), split into one slice per device, decoded by the same loop as
`decode.generate`, and returned in input order with the padding dropped. Parameters are
replicated once per model and reused across calls.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from localleap_jax.decode import (DecodeConfig, Generation, compile_once, decode_loop, generate, prepare_inputs,
                                  denoiser_of, special_ids, trace_of)

_REPLICATED: dict = {}  # id(params), devices -> (params, replicated denoiser); one model at a time


def _replicated(model, devices):
    """The model's denoiser with a full copy of its parameters on every device (made once per model)."""
    key = (id(model.params), tuple(devices))
    hit = _REPLICATED.get(key)
    if hit is None or hit[0] is not model.params:
        _REPLICATED.clear()  # hold at most one replicated model on the devices
        mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
        everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # a full copy per device
        hit = _REPLICATED[key] = (model.params, jax.device_put(denoiser_of(model), everywhere))
    return hit[1]


def generate_parallel(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), rng: jax.Array | None = None,
                      devices=None, *, trace: bool = False) -> Generation:
    """`generate`, with the batch split across `devices` (default: all local devices)."""
    devices = list(devices or jax.local_devices())
    if len(devices) == 1:
        return generate(model, ids, mask, cfg, rng, trace=trace)
    n = len(devices)
    ids_b, mask_b, pad = prepare_inputs(ids, mask, cfg, model.config, rng)
    B = ids_b.shape[0]
    per = -(-B // n)
    fill = per * n - B

    def split(a):  # [B, ...] -> [n, per, ...], padded with copies of row 0 (a valid prompt, valid settings)
        a = np.asarray(a)
        return np.concatenate([a, np.repeat(a[:1], fill, axis=0)]).reshape(n, per, *a.shape[1:])

    rule = jax.tree.map(split, cfg.rule.with_rows(B))
    ids_b, mask_b = split(ids_b), split(mask_b)
    sampling = cfg.temperature > 0
    keys = jax.random.split(rng, n) if sampling else None
    special = special_ids(model)
    loop_settings = cfg.loop_settings(trace)
    denoiser = _replicated(model, devices)

    loop = functools.partial(decode_loop, loop=loop_settings, special=special)
    pmapped = jax.pmap(loop, in_axes=(None, 0, 0, 0 if sampling else None, 0), devices=devices)
    inputs = (ids_b, mask_b, keys, rule)
    fn, compile_s = compile_once(denoiser, inputs, ("pmap", loop_settings, special, tuple(devices)),
                                 lambda: pmapped.lower(denoiser, *inputs))
    t0 = time.perf_counter()
    out = fn(denoiser, *inputs)
    merge = lambda a: np.asarray(a).reshape(n * per, *np.shape(a)[2:])[:B]  # noqa: E731
    x = merge(out.x)
    seconds = time.perf_counter() - t0
    nfe = merge(out.nfe)
    P = ids_b.shape[2]
    return Generation(tokens=x[:, pad:], nfe=nfe, forward_passes=int(np.max(out.passes)),
                      full_passes=int(np.max(out.full_passes)), prompt_length=P - pad, seconds=seconds,
                      compile_seconds=compile_s,
                      trace=trace_of(jax.tree.map(merge, out.trace), x, nfe, P, rule.clause_names) if trace else None)
