"""Meshes and parameter partitioning: which devices form the (data, model) mesh, and which dimension of each
parameter leaf the "model" axis splits. Specs only: nothing here runs a program (the runners are in
`localleap_jax.dist`), so checkpoint reading may use it to restore straight into shards.

Parameters are split Megatron-style over "model" (`param_specs`): q/k/v and the MLP's gate/up
projections by output column (heads, hidden units), the attention output and the MLP's down
projection by input row, the embedding and the LM head by vocabulary; norms are replicated. A leaf
whose split dimension does not divide by the model axis stays replicated (correct, just not split).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from localleap_jax.errors import DecodeError

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


__all__ = ["DATA", "MODEL", "make_mesh", "mesh_from_text", "model_split_axis", "param_shardings", "param_specs",
           "parse_mesh", "path_names", "spec_for"]
