"""The earlier home of meshes and sharded decoding, kept so its names keep working: meshes and parameter
specs are in `localleap_jax.partition`, the sharded runner in `localleap_jax.dist.mesh`."""

from localleap_jax.dist.mesh import addressable_bytes, generate_sharded, on_mesh, shard_params
from localleap_jax.partition import (DATA, MODEL, make_mesh, mesh_from_text, model_split_axis, param_shardings,
                                     param_specs, parse_mesh, path_names, spec_for)

__all__ = ["DATA", "MODEL", "addressable_bytes", "generate_sharded", "make_mesh", "mesh_from_text", "model_split_axis",
           "on_mesh", "param_shardings", "param_specs", "parse_mesh", "path_names", "shard_params", "spec_for"]
