"""Data-parallel generation over local devices with `pmap`.

The batch is padded to a multiple of the device count (with copies of its first row, so every padding row
is a valid prompt), split into one slice per device, decoded by the same loop as on one device, and
returned in input order with the padding dropped. Parameters are replicated once per model and reused.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from localleap_jax.decode import LoopOutput

_REPLICATED: dict = {}  # devices -> (the denoiser's leaves, its replicated copy); one model at a time


def _replicated(denoiser, devices: tuple):
    """`denoiser` with a full copy of its arrays on every device, made once per model and reused."""
    leaves = jax.tree.leaves(denoiser)
    hit = _REPLICATED.get(devices)
    if hit is None or len(hit[0]) != len(leaves) or any(a is not b for a, b in zip(hit[0], leaves)):
        _REPLICATED.clear()  # hold at most one replicated model on the devices
        mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
        everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # a full copy per device
        hit = _REPLICATED[devices] = (leaves, jax.device_put(denoiser, everywhere))
    return hit[1]


@dataclasses.dataclass(frozen=True)
class Replicated:
    """One slice of the batch per device, each with a full copy of the weights."""

    devices: tuple
    kind = "decode/pmap"
    local = True  # this process's devices

    def rows(self, batch):
        return -(-batch // len(self.devices)) * len(self.devices)

    def place(self, denoiser, ids, mask, key, rule, draws):
        n = len(self.devices)
        split = lambda a: np.asarray(a).reshape(n, -1, *np.shape(a)[1:])  # noqa: E731  [rows] -> [n, rows / n]
        keys = None if key is None else jax.random.split(key, n)
        return _replicated(denoiser, self.devices), (split(ids), split(mask), keys, jax.tree.map(split, rule),
                                                     jax.tree.map(split, draws))

    def lower(self, loop_fn, denoiser, inputs):
        sampling = inputs[2] is not None
        return jax.pmap(loop_fn, in_axes=(None, 0, 0, 0 if sampling else None, 0, 0),
                        devices=list(self.devices)).lower(denoiser, *inputs)

    def fetch(self, out, batch):
        merge = lambda a: np.asarray(a).reshape(-1, *np.shape(a)[2:])[:batch]  # noqa: E731
        return LoopOutput(merge(out.x), merge(out.nfe), int(np.max(out.passes)), int(np.max(out.full_passes)),
                          jax.tree.map(merge, out.record), jax.tree.map(merge, out.remasks),
                          jax.tree.map(merge, out.edits), jax.tree.map(merge, out.indels))
