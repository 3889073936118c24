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
                                  special_ids)

_REPLICATED: dict = {}  # id(params), devices -> (params, replicated params); one model at a time


def _replicated(params, devices):
    key = (id(params), tuple(devices))
    hit = _REPLICATED.get(key)
    if hit is None or hit[0] is not params:
        _REPLICATED.clear()  # hold at most one replicated model on the devices
        mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
        everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # a full copy per device
        hit = _REPLICATED[key] = (params, jax.device_put(params, everywhere))
    return hit[1]


def generate_parallel(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), rng: jax.Array | None = None,
                      devices=None) -> Generation:
    """`generate`, with the batch split across `devices` (default: all local devices)."""
    devices = list(devices or jax.local_devices())
    if len(devices) == 1:
        return generate(model, ids, mask, cfg, rng)
    n = len(devices)
    ids_b, mask_b, pad = prepare_inputs(ids, mask, cfg, model.config, rng)
    B = ids_b.shape[0]
    per = -(-B // n)
    fill = per * n - B
    ids_b = np.concatenate([ids_b, np.repeat(ids_b[:1], fill, axis=0)]).reshape(n, per, -1)
    mask_b = np.concatenate([mask_b, np.repeat(mask_b[:1], fill, axis=0)]).reshape(n, per, -1)
    sampling = cfg.temperature > 0
    keys = jax.random.split(rng, n) if sampling else None
    special = special_ids(model)
    params = _replicated(model.params, devices)

    loop = functools.partial(decode_loop, config=model.config, cfg=cfg, special=special)
    pmapped = jax.pmap(loop, in_axes=(None, 0, 0, 0 if sampling else None), devices=devices)
    fn, compile_s = compile_once(model.params, (ids_b, mask_b, keys),
                                 ("pmap", model.config, cfg, special, tuple(devices)),
                                 lambda: pmapped.lower(params, ids_b, mask_b, keys))
    t0 = time.perf_counter()
    x, nfe, passes, full = fn(params, ids_b, mask_b, keys)
    x = np.asarray(x).reshape(n * per, -1)[:B]
    seconds = time.perf_counter() - t0
    return Generation(tokens=x[:, pad:], nfe=np.asarray(nfe).reshape(-1)[:B], forward_passes=int(np.max(passes)),
                      full_passes=int(np.max(full)), prompt_length=ids_b.shape[2] - pad, seconds=seconds,
                      compile_seconds=compile_s)
