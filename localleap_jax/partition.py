"""Meshes and parameter partitioning: which devices form the (data, model) or (data, expert, model) mesh, and
which dimension of each parameter leaf the "model" or "expert" axis splits. Specs only: nothing here runs a
program (the runners are in `localleap_jax.dist`), so checkpoint reading may use it to restore straight into
shards.

Parameters are split Megatron-style over "model" (`param_specs`): q/k/v and the MLP's gate/up
projections by output column (heads, hidden units), the attention output and the MLP's down
projection by input row, the embedding and the LM head by vocabulary; norms are replicated. A leaf
whose split dimension does not divide by the model axis stays replicated (correct, just not split).

Routed experts (the leaves under a key "experts", `localleap_jax.moe`'s layout: [E, in, out] per layer,
[N, E, in, out] layer-stacked) are split over "expert" on their expert dimension, so each device of that axis
holds E / expert of them (whole: the model axis does not split them too); `moe.moe_layer(..., mesh=mesh)`
runs them there. A mesh has the "expert" axis only when it is asked for (expert > 1): a mesh without it is
the (data, model) mesh every runner took before.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from localleap_jax.errors import DecodeError

DATA, EXPERT, MODEL = "data", "expert", "model"
ROUTED_EXPERTS = "experts"  # the key of a MoE layer's routed experts (localleap_jax.moe's parameter layout)

# Which dimension of each block matrix the model axis splits (leaves are layer-stacked: [n_layers, in, out]).
_BY_OUTPUT = ("q_proj", "k_proj", "v_proj", "ff_proj", "up_proj",  # column-parallel: heads / hidden units
              "shared_gate_proj", "shared_up_proj")  # (a MoE layer's shared experts: one SwiGLU)
_BY_INPUT = ("attn_out", "ff_out", "shared_down_proj")  # row-parallel: the matching input rows, then an all-reduce


def make_mesh(data: int | None = None, model: int = 1, devices=None, *, expert: int = 1) -> Mesh:
    """A (data, model) mesh, or with expert > 1 a (data, expert, model) mesh, over `devices` (default: all
    devices of all processes); `data` defaults to what is left after the other axes. `make_mesh(2, 4)` is
    data=2, model=4."""
    for axis, size in (("data", data), ("model", model), ("expert", expert)):
        if size is None and axis == "data":
            continue
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 1:
            rest = " (or None: what the other axes leave)" if axis == "data" else ""
            raise DecodeError(f"make_mesh: {axis}={size!r} must be a positive whole number{rest}")
    try:
        devices = list(jax.devices() if devices is None else devices)
    except TypeError:
        raise DecodeError(f"make_mesh: devices={devices!r:.40} must be a list of devices (jax.devices())") from None
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise DecodeError(f"make_mesh: devices must be a non-empty list of JAX devices (jax.devices()), got "
                          f"{devices!r:.60}")
    if expert < 1 or model < 1 or len(devices) % (expert * model):
        raise DecodeError(f"{_axes_text(expert=expert, model=model)} does not divide the {len(devices)} devices")
    data = len(devices) // (expert * model) if data is None else data
    if data < 1 or data * expert * model > len(devices):
        raise DecodeError(f"a mesh of {_axes_text(data=data, expert=expert, model=model)} needs "
                          f"{data * expert * model} devices; there are {len(devices)}")
    # Keep each model (and expert) group on one host where possible: consecutive devices of the same process.
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))[:data * expert * model]
    if expert == 1:
        return Mesh(np.array(devices).reshape(data, model), (DATA, MODEL))
    return Mesh(np.array(devices).reshape(data, expert, model), (DATA, EXPERT, MODEL))


def _axes_text(**sizes) -> str:
    """'data=2 x model=4' (the expert axis named only when it is split)."""
    return " x ".join(f"{axis}={size}" for axis, size in sizes.items() if axis != EXPERT or size != 1)


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4}; 'data=2,expert=4' -> {'data': 2, 'expert': 4} (any axis
    may be left out). ';' also separates the axes, for lm-eval's --model_args, which splits at commas:
    mesh=data=2;model=4."""
    out = {}
    wanted = f"mesh {text!r}: expected data=D,model=M (and expert=E) with positive whole numbers"
    for item in filter(None, (t.strip() for t in text.replace(";", ",").split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in (DATA, EXPERT, MODEL) or not value.strip().isdigit() or int(value) < 1:
            raise DecodeError(wanted)
        if key.strip() in out:
            raise DecodeError(f"mesh {text!r}: {key.strip()} given twice")
        out[key.strip()] = int(value)
    if not out:
        raise DecodeError(wanted)
    return out


def mesh_from_text(text: str, devices=None) -> Mesh:
    """The mesh a command line's --mesh names, over every device (of every process): expert defaults to 1;
    of data and model, one left out takes what the other axes leave (both left out: data does), and the
    axes must use all the devices (an idle device is a mistake, not a choice a command line should make
    silently)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes, n = parse_mesh(text), len(devices)
    given = dict(sizes)
    sizes.setdefault(EXPERT, 1)
    if DATA not in sizes and MODEL not in sizes:
        sizes[MODEL] = 1
    for axis in (DATA, MODEL):
        if axis not in sizes:
            others = sizes[EXPERT] * sizes[MODEL if axis == DATA else DATA]
            if n % others:
                raise DecodeError(f"mesh {text!r}: {_axes_text(**given)} does not divide the {n} devices")
            sizes[axis] = n // others
    total = sizes[DATA] * sizes[EXPERT] * sizes[MODEL]
    if total != n:
        names = " x ".join(a for a in (DATA, EXPERT, MODEL) if a != EXPERT or EXPERT in given)
        raise DecodeError(f"mesh {text!r}: {names} = {total} devices, but there are {n} "
                          "(the mesh must use every device)")
    return make_mesh(sizes[DATA], sizes[MODEL], devices, expert=sizes[EXPERT])


def model_split_axis(path: tuple[str, ...], shape: tuple[int, ...]) -> int | None:
    """The dimension of a parameter leaf the model axis splits (None: replicated). A layer's matrices are
    [in, out] in the decoding layout (path "layers", i, ...) and [n_layers, in, out] layer-stacked ("blocks", ...)."""
    stack = path[0] in ("blocks", "moe_blocks") or path[0].startswith(("blocks_", "moe_blocks_"))  # model.segments
    layer = path[1:] if stack else path[2:] if path[0] == "layers" else None  # the path inside one layer
    where = None if layer is None else layer[1] if len(layer) > 2 and layer[0] == "moe" else layer[0]
    if where in _BY_OUTPUT:
        return len(shape) - 1  # kernel [(N,) in, out] and bias [(N,) out]: the output columns
    if where in _BY_INPUT and path[-1] == "kernel":
        return len(shape) - 2  # [(N,) in, out]: the input rows
    if path[0] == "wte":
        return 0  # [V, D]: the vocabulary
    if path[0] == "ff_out":
        return 1  # the LM head [D, V]: the vocabulary
    return None  # norms


def expert_split_axis(path: tuple[str, ...], shape: tuple[int, ...]) -> int | None:
    """The expert dimension of a routed-expert leaf (None: not one). A routed expert matrix is [E, in, out] in
    one layer and [N, E, in, out] layer-stacked: the expert dimension is the third from the end."""
    if ROUTED_EXPERTS in path[:-1] and len(shape) >= 3:
        return len(shape) - 3
    return None


def spec_for(path: tuple[str, ...], shape: tuple[int, ...], model_size: int, expert_size: int = 1) -> P:
    """The PartitionSpec of one parameter leaf (path as in the Flax tree, e.g. ('blocks', 'q_proj', 'kernel')).
    Routed experts are split over "expert" (never over "model"); every other leaf as `model_split_axis` says."""
    expert_axis = expert_split_axis(path, shape)
    if expert_axis is not None:
        if expert_size == 1 or shape[expert_axis] % expert_size:
            return P()
        return P(*(EXPERT if d == expert_axis else None for d in range(len(shape))))
    axis = model_split_axis(path, shape)
    if axis is None or model_size == 1 or shape[axis] % model_size:
        return P()
    return P(*(MODEL if d == axis else None for d in range(len(shape))))


def path_names(keypath) -> tuple[str, ...]:
    """('blocks', 'q_proj', 'kernel') from a jax key path."""
    return tuple(str(getattr(k, "key", k)) for k in keypath)


def param_specs(params, model_size: int, expert_size: int = 1):
    """PartitionSpecs for a parameter tree (or an abstract one: only shapes are read)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec_for(path_names(path), tuple(leaf.shape), model_size, expert_size),
        params)


def param_shardings(params, mesh: Mesh):
    sizes = dict(mesh.shape)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                        param_specs(params, sizes[MODEL], sizes.get(EXPERT, 1)))


__all__ = ["DATA", "EXPERT", "MODEL", "ROUTED_EXPERTS", "expert_split_axis", "make_mesh", "mesh_from_text",
           "model_split_axis", "param_shardings", "param_specs", "parse_mesh", "path_names", "spec_for"]
