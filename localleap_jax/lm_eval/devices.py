"""Devices and processes of an evaluation: joining the other processes the model arguments name, the mesh
to generate on, and a follower's whole evaluation (every process runs the same command; process 0 runs
lm-eval, the others carry out its generations)."""

from __future__ import annotations

import jax

from localleap_jax import processes
from localleap_jax.compile_cache import DEFAULT_DIR, enable_compilation_cache
from localleap_jax.decode import DecodeError
from localleap_jax.dist.multihost import follow_until_stopped, mesh_for_run
from localleap_jax.lm_eval.args import ModelArgsError


def processes_of(settings: dict) -> processes.Processes:
    try:
        return processes.processes_from(settings["coordinator"], settings["num_processes"], settings["process_id"],
                                        flags={k: f"model_args {k}" for k in processes.FLAGS})
    except processes.DistributedError as e:
        raise ModelArgsError(str(e)) from None


def join_and_mesh(settings: dict):
    """Join the other processes if model_args say so and nobody has yet, then the mesh to generate on:
    model_args mesh over every device, model=1 for several processes without one, else None (pmap)."""
    joining = processes_of(settings)
    if joining.joins and not jax.distributed.is_initialized():
        processes.initialize(joining)
    if isinstance(settings["mesh"], jax.sharding.Mesh):
        return settings["mesh"]
    try:
        return mesh_for_run(settings["mesh"])
    except DecodeError as e:
        raise ModelArgsError(f"model_args {e}") from None


def follow(compile_cache: bool) -> int:
    """A follower's whole evaluation: carry out process 0's generations until it stops (no lm-eval, no
    files). With `compile_cache` it reads the programs process 0 compiled before, where there are any
    (JAX writes entries only from process 0, and a follower creates no directory)."""
    if compile_cache and DEFAULT_DIR is not None and DEFAULT_DIR.is_dir():
        enable_compilation_cache()
    return follow_until_stopped("evaluation")
