"""Where the work of one call runs: one device, a pmap over local devices, or a (data, model) mesh (one process
or several). The front door (`ll.generate`, `ll.loglikelihood`) and the multi-process leader and followers all
choose here, so every way to run a generation is one `decode.run` with a placement.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from localleap_jax.decode import OneDevice, Placement
from localleap_jax.dist.mesh import DataModelMesh, LikelihoodOnMesh
from localleap_jax.dist.pmap import Replicated
from localleap_jax.errors import DecodeError

_MESH_HINT = "ll.make_mesh(data=..., model=...)"


def _check_mesh(mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise DecodeError(f"mesh must be a jax Mesh ({_MESH_HINT}), got {type(mesh).__name__}")
    return mesh


def decode_placement(mesh=None, devices=None) -> Placement:
    """`mesh`: the batch over "data", the weights over "model"; `devices` (local devices): a full copy of the weights
    on each, the batch split over them (pmap); neither: one device."""
    if mesh is not None and devices is not None:
        raise DecodeError("pass mesh= or devices=, not both (a mesh already names its devices)")
    if mesh is not None:
        return DataModelMesh(_check_mesh(mesh))
    if devices is not None:
        try:
            devices = tuple(devices)
        except TypeError:
            devices = None
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise DecodeError("devices must be a non-empty list of local JAX devices (jax.local_devices()), or None "
                              "(one device)")
        return Replicated(devices) if len(devices) > 1 else OneDevice()
    return OneDevice()


def likelihood_placement(mesh=None):
    """The requests over "data" and the weights over "model" of `mesh`; None: one device."""
    return None if mesh is None else LikelihoodOnMesh(_check_mesh(mesh))
