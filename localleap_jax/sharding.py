"""Decoding on a device mesh: a "data" axis that splits the batch and a "model" axis that splits the weights.

    from localleap_jax.sharding import make_mesh
    mesh = make_mesh(data=2, model=4)                      # over jax.devices(), every host's
    model = ll.load(path, mesh=mesh)                      # parameters restored straight into their shards
    out = ll.generate(model, ids, mask, cfg, mesh=mesh)   # the same tokens as on one device

Parameters are split Megatron-style over "model" (`param_specs`): q/k/v and the MLP's gate/up
projections by output column (heads, hidden units), the attention output and the MLP's down
projection by input row, the embedding and the LM head by vocabulary; norms are replicated. A leaf
whose split dimension does not divide by the model axis stays replicated (correct, just not split).
XLA's SPMD partitioner inserts the collectives; the KV cache follows the heads' split.

The batch is split over "data" with `shard_map`, so each data shard runs its own decode loop: its
"all rows done" test covers only its rows, and a shard never waits for the slowest row of another
(a plain `jit` over a data-sharded batch would make the test global). Inside a shard the "model" axis
stays automatic. Rows are padded to a multiple of the data axis with copies of row 0, as `pmap` does.

On several hosts (`initialize_distributed`), every process runs the same program on the same global
batch; each holds only its devices' shards, and the results are gathered to every process.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from localleap_jax.decode import (DecodeConfig, DecodeError, Generation, LoopOutput, TraceBuffers, compile_once,
                                  decode_loop, prepare_inputs, special_ids, trace_of)
from localleap_jax.denoiser import ModelDenoiser

DATA, MODEL = "data", "model"

# Which dimension of each block matrix the model axis splits (leaves are layer-stacked: [n_layers, in, out]).
_BY_OUTPUT = ("q_proj", "k_proj", "v_proj", "ff_proj", "up_proj")  # column-parallel: heads / hidden units
_BY_INPUT = ("attn_out", "ff_out")  # row-parallel: the matching input rows, then an all-reduce


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all devices of all processes); `data` defaults to
    what is left after the model axis."""
    devices = list(jax.devices() if devices is None else devices)
    if model < 1 or len(devices) % model:
        raise DecodeError(f"model={model} does not divide the {len(devices)} devices")
    data = len(devices) // model if data is None else data
    if data < 1 or data * model > len(devices):
        raise DecodeError(f"a mesh of data={data} x model={model} needs {data * model} devices; "
                          f"there are {len(devices)}")
    # Keep each model group on one host where possible: consecutive devices of the same process.
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))[:data * model]
    return Mesh(np.array(devices).reshape(data, model), (DATA, MODEL))


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4} (either may be left out). ';' also separates the
    axes, for lm-eval's --model_args, which splits at commas: mesh=data=2;model=4."""
    out = {}
    for item in filter(None, (t.strip() for t in text.replace(";", ",").split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in (DATA, MODEL) or not value.strip().isdigit() or int(value) < 1:
            raise DecodeError(f"mesh {text!r}: expected data=D,model=M with positive whole numbers")
        if key.strip() in out:
            raise DecodeError(f"mesh {text!r}: {key.strip()} given twice")
        out[key.strip()] = int(value)
    if not out:
        raise DecodeError(f"mesh {text!r}: expected data=D,model=M with positive whole numbers")
    return out


def mesh_from_text(text: str, devices=None) -> Mesh:
    """The mesh a command line's --mesh names, over every device (of every process): an axis left out
    takes what the other leaves, and data x model must use all the devices (an idle device is a
    mistake, not a choice a command line should make silently)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes, n = parse_mesh(text), len(devices)
    for axis, other in ((DATA, MODEL), (MODEL, DATA)):
        if axis not in sizes:
            if n % sizes[other]:
                raise DecodeError(f"mesh {text!r}: {other}={sizes[other]} does not divide the {n} devices")
            sizes[axis] = n // sizes[other]
    if sizes[DATA] * sizes[MODEL] != n:
        raise DecodeError(f"mesh {text!r}: data x model = {sizes[DATA] * sizes[MODEL]} devices, but there are {n} "
                          "(the mesh must use every device)")
    return make_mesh(sizes[DATA], sizes[MODEL], devices)


def model_split_axis(path: tuple[str, ...], shape: tuple[int, ...]) -> int | None:
    """The dimension of a parameter leaf the model axis splits (None: replicated). Leaves are
    layer-stacked: block matrices are [n_layers, in, out]."""
    if path[0] == "blocks" and path[1] in _BY_OUTPUT:
        return len(shape) - 1  # kernel [N, in, out] and bias [N, out]: the output columns
    if path[0] == "blocks" and path[1] in _BY_INPUT and path[-1] == "kernel":
        return 1  # [N, in, out]: the input rows
    if path[0] == "wte":
        return 0  # [V, D]: the vocabulary
    if path[0] == "ff_out":
        return 1  # the LM head [D, V]: the vocabulary
    return None  # norms


def spec_for(path: tuple[str, ...], shape: tuple[int, ...], model_size: int) -> P:
    """The PartitionSpec of one parameter leaf (path as in the Flax tree, e.g. ('blocks', 'q_proj', 'kernel'))."""
    axis = model_split_axis(path, shape)
    if axis is None or model_size == 1 or shape[axis] % model_size:
        return P()
    return P(*(MODEL if d == axis else None for d in range(len(shape))))


def path_names(keypath) -> tuple[str, ...]:
    """('blocks', 'q_proj', 'kernel') from a jax key path."""
    return tuple(str(getattr(k, "key", k)) for k in keypath)


def param_specs(params, model_size: int):
    """PartitionSpecs for a parameter tree (or an abstract one: only shapes are read)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec_for(path_names(path), tuple(leaf.shape), model_size),
        params)


def param_shardings(params, mesh: Mesh):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, mesh.shape[MODEL]))


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


def _params_on(model, mesh: Mesh):
    if on_mesh(model.params, mesh):
        return model.params
    key = (id(model.params), mesh)
    hit = _SHARDED_PARAMS.get(key)
    if hit is None or hit[0] is not model.params:
        _SHARDED_PARAMS.clear()
        hit = _SHARDED_PARAMS[key] = (model.params, shard_params(model.params, mesh))
    return hit[1]


def generate_sharded(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), mesh: Mesh | None = None, *,
                     rng: jax.Array | None = None, trace: bool = False) -> Generation:
    """`generate` on a (data, model) mesh: one decode loop per data shard, weights split over "model"."""
    if mesh is None or tuple(mesh.axis_names) != (DATA, MODEL):
        raise DecodeError("generate_sharded needs a mesh with axes ('data', 'model'): "
                          "localleap_jax.sharding.make_mesh(data=..., model=...)")
    ids_b, mask_b, pad = prepare_inputs(ids, mask, cfg, model.config, rng)
    B, D = ids_b.shape[0], mesh.shape[DATA]
    fill = -(-B // D) * D - B

    def pad_rows(a):  # copies of row 0: a valid prompt with valid settings
        a = np.asarray(a)
        return np.concatenate([a, np.repeat(a[:1], fill, axis=0)])

    rule = jax.tree.map(pad_rows, cfg.rule.with_rows(B))
    ids_p, mask_p = pad_rows(ids_b), pad_rows(mask_b)
    sampling = cfg.temperature > 0
    keys = jax.random.key_data(jax.random.split(rng, D)) if sampling else None  # one stream per data shard
    loop = cfg.loop_settings(trace)
    special = special_ids(model)
    denoiser = ModelDenoiser(_params_on(model, mesh), model.config)

    def per_shard(den, shard_ids, shard_mask, shard_keys, shard_rule):
        key = None if shard_keys is None else jax.random.wrap_key_data(shard_keys[0])
        out = decode_loop(den, shard_ids, shard_mask, key, shard_rule, loop=loop, special=special)
        return out._replace(passes=out.passes[None], full_passes=out.full_passes[None])  # one per shard

    rows = P(DATA)
    trace_spec = TraceBuffers(rows, rows, rows, rows) if trace else ()
    sharded = jax.jit(jax.shard_map(
        per_shard, mesh=mesh, in_specs=(P(), rows, rows, rows if sampling else None, rows),
        out_specs=LoopOutput(rows, rows, rows, rows, trace_spec), axis_names={DATA}, check_vma=False))
    batch = NamedSharding(mesh, rows)
    inputs = (_global(ids_p, batch), _global(mask_p, batch),
              None if keys is None else _global(np.asarray(keys), batch),
              jax.tree.map(lambda a: _global(a, batch), rule))
    compiled, compile_s = compile_once(denoiser, inputs, ("sharded", loop, special, mesh),
                                       lambda: sharded.lower(denoiser, *inputs))
    t0 = time.perf_counter()
    out = compiled(denoiser, *inputs)
    x = _to_host(out.x)[:B]
    seconds = time.perf_counter() - t0
    nfe = _to_host(out.nfe)[:B]
    P_len = ids_b.shape[1]
    buffers = jax.tree.map(lambda a: _to_host(a)[:B], out.trace) if trace else None
    return Generation(tokens=x[:, pad:], nfe=nfe, forward_passes=int(np.max(_to_host(out.passes))),
                      full_passes=int(np.max(_to_host(out.full_passes))), prompt_length=P_len - pad,
                      seconds=seconds, compile_seconds=compile_s,
                      trace=trace_of(buffers, x, nfe, P_len, cfg.rule.clause_names) if trace else None)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """`jax.distributed.initialize`, from arguments or the usual environment (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID; coordinator "auto": a cluster JAX detects itself, TPU pods,
    SLURM). On CPU the cross-process collectives use gloo. See localleap_jax.multihost."""
    from localleap_jax import multihost
    multihost.initialize(multihost.processes_from(coordinator, num_processes, process_id))


__all__ = ["DATA", "MODEL", "addressable_bytes", "generate_sharded", "initialize_distributed", "make_mesh",
           "mesh_from_text", "model_split_axis", "param_shardings", "param_specs", "parse_mesh", "shard_params"]
