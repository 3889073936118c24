"""Decoding on a device mesh: a "data" axis that splits the batch and a "model" axis that splits the weights.

    mesh = ll.make_mesh(data=2, model=4)                   # over jax.devices(), every host's
    model = ll.load(path, mesh=mesh)                      # parameters restored straight into their shards
    out = ll.generate(model, ids, mask, cfg, mesh=mesh)   # the same tokens as on one device

Parameters are split as `partition.param_specs` says; XLA's SPMD partitioner inserts the collectives and
the KV cache follows the heads' split. The batch is split over "data" with `shard_map`, so each data shard
runs its own decode loop: its "all rows done" test covers only its rows, and a shard never waits for the
slowest row of another (a plain `jit` over a data-sharded batch would make the test global). Inside a shard
the "model" axis stays automatic. Rows are padded to a multiple of the data axis with copies of row 0.

On several processes (localleap_jax.dist.multihost) every process runs the same program on the same global
batch; each holds only its devices' shards, and the results are gathered to every process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from localleap_jax.decode import LoopOutput
from localleap_jax.errors import DecodeError
from localleap_jax.likelihood.program import Requests
from localleap_jax.partition import DATA, EXPERT, MODEL, param_shardings


def shard_params(params, mesh: Mesh):
    """Place a (host or single-device) parameter tree on the mesh, each leaf split as `param_specs` says."""
    return jax.tree.map(jax.device_put, params, param_shardings(params, mesh))


def on_mesh(params, mesh: Mesh) -> bool:
    leaves = jax.tree.leaves(params)
    return all(isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh
               for a in leaves)


def addressable_bytes(params) -> dict[Any, int]:
    """Parameter bytes held by each local device (from the arrays' addressable shards)."""
    out: dict[Any, int] = {}
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def _global(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from the full host copy every process holds (each process supplies its own shards)."""
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def _to_host(a: jax.Array) -> np.ndarray:
    if a.is_fully_addressable:
        return np.asarray(a)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


_SHARDED_PARAMS: dict = {}  # (id(params), mesh) -> (params, params placed on the mesh); one model at a time


def _params_on(params, mesh: Mesh):
    if on_mesh(params, mesh):
        return params
    key = (id(params), mesh)
    hit = _SHARDED_PARAMS.get(key)
    if hit is None or hit[0] is not params:
        _SHARDED_PARAMS.clear()
        hit = _SHARDED_PARAMS[key] = (params, shard_params(params, mesh))
    return hit[1]


@dataclasses.dataclass(frozen=True)
class _OnDataModelMesh:
    """What both placements on a (data, model) mesh share: the axes checked, rows a multiple of "data"."""

    mesh: Mesh

    def __post_init__(self):
        if tuple(self.mesh.axis_names) not in ((DATA, MODEL), (DATA, EXPERT, MODEL)):
            raise DecodeError("running on a mesh needs the axes ('data', 'model') or ('data', 'expert', 'model'): "
                              "ll.make_mesh(data=..., expert=..., model=...)")

    def rows(self, batch):
        D = self.mesh.shape[DATA]
        return -(-batch // D) * D


@dataclasses.dataclass(frozen=True)
class DataModelMesh(_OnDataModelMesh):
    """Rows split over the mesh's "data" axis, one decode loop per data shard; weights split over "model"."""

    kind = "decode/mesh"
    local = False  # the mesh may span processes

    def place(self, denoiser, ids, mask, key, rule, draws):
        denoiser = denoiser.replace(params=_params_on(denoiser.params, self.mesh))
        batch = NamedSharding(self.mesh, P(DATA))
        put = lambda a: _global(np.asarray(a), batch)  # noqa: E731
        keys = self._shard_keys(key)
        return denoiser, (put(ids), put(mask), None if keys is None else put(keys), jax.tree.map(put, rule),
                          jax.tree.map(put, draws))

    def shapes(self, denoiser, ids, mask, key, rule, draws):
        """What `place` gives, as shapes with their shardings and no arrays: the denoiser's (possibly abstract)
        parameters split as `param_shardings` says, the rows over "data". For lowering where the devices are only
        described (a TPU topology on another host)."""
        params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s),
                              denoiser.params, param_shardings(denoiser.params, self.mesh))
        batch = NamedSharding(self.mesh, P(DATA))
        put = lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=batch)  # noqa: E731
        keys = self._shard_keys(key)
        return denoiser.replace(params=params), (put(ids), put(mask), None if keys is None else put(keys),
                                                 jax.tree.map(put, rule), jax.tree.map(put, draws))

    def _shard_keys(self, key):
        """One sampling key per data shard (its key data), or None."""
        return None if key is None else np.asarray(jax.random.key_data(jax.random.split(key, self.mesh.shape[DATA])))

    def lower(self, loop_fn, denoiser, inputs):
        def per_shard(den, shard_ids, shard_mask, shard_keys, shard_rule, shard_draws):
            key = None if shard_keys is None else jax.random.wrap_key_data(shard_keys[0])  # one stream per shard
            out = loop_fn(den, shard_ids, shard_mask, key, shard_rule, shard_draws)
            return out._replace(passes=out.passes[None], full_passes=out.full_passes[None])  # one per shard

        rows = P(DATA)
        sharded = jax.shard_map(per_shard, mesh=self.mesh,
                                in_specs=(P(), rows, rows, rows if inputs[2] is not None else None, rows, rows),
                                out_specs=rows, axis_names={DATA}, check_vma=False)
        return jax.jit(sharded).lower(denoiser, *inputs)

    def fetch(self, out, batch):
        rows = lambda a: _to_host(a)[:batch]  # noqa: E731
        return LoopOutput(rows(out.x), rows(out.nfe), int(np.max(_to_host(out.passes))),
                          int(np.max(_to_host(out.full_passes))), jax.tree.map(rows, out.record),
                          jax.tree.map(rows, out.remasks), jax.tree.map(rows, out.edits),
                          jax.tree.map(rows, out.indels))


@dataclasses.dataclass(frozen=True)
class LikelihoodOnMesh(_OnDataModelMesh):
    """Likelihood requests split over the mesh's "data" axis, weights over "model": one jitted program (it has
    no early exit, so no per-shard loop is needed) that XLA's SPMD partitioner splits."""

    kind = "likelihood/mesh"

    def place(self, denoiser, requests: Requests):
        denoiser = denoiser.replace(params=_params_on(denoiser.params, self.mesh))
        rows = NamedSharding(self.mesh, P(DATA))
        put = lambda a: _global(np.asarray(a), rows)  # noqa: E731
        keys = jax.random.wrap_key_data(put(jax.random.key_data(requests.keys)))
        return denoiser, Requests(put(requests.ids), put(requests.mask), put(requests.length), keys)

    def fetch(self, out, rows):
        return _to_host(out)[:rows]


__all__ = ["DataModelMesh", "LikelihoodOnMesh", "addressable_bytes", "on_mesh", "shard_params"]
