"""The front door: `ll.load`, `ll.generate` and `ll.loglikelihood`, which choose where the work runs.

    model = ll.load(path, dtype="bfloat16", verify=True, mesh=None)
    out = ll.generate(model, ids, mask, cfg, rng, trace=False, mesh=None, devices=None)
    logp = ll.loglikelihood(model, contexts, continuations, ll.LikelihoodConfig(), mesh=None)

`generate` runs on one device by default; with `devices` (several local devices) the batch is split over
them with a full copy of the weights on each (pmap); with `mesh` (a (data, model) mesh from
`localleap_jax.partition.make_mesh`) the batch is split over "data" and the weights over "model". Every
choice gives the same tokens. `load` restores onto one device, or straight into the mesh's shards; with
several processes every process loads at once and all raise if any fails.
"""

from __future__ import annotations

import jax

from localleap_jax.checkpoint import Model
from localleap_jax.convert_hf import resolve_checkpoint
from localleap_jax.decode import DecodeConfig, DecodeError, Generation, generate as generate_on_one_device
from localleap_jax.dist import multihost
from localleap_jax.dist.mesh import LikelihoodOnMesh, generate_sharded
from localleap_jax.dist.pmap import generate_parallel
from localleap_jax.likelihood import LikelihoodConfig, greedy_match, loglikelihood as loglikelihood_on


def load(path, dtype="bfloat16", verify: bool = True, mesh=None) -> Model:
    """Restore a checkpoint (see `localleap_jax.checkpoint.load`): into `dtype`, on one device or, with `mesh`,
    straight into each parameter's shards; on several processes, every process at once. `path`: a checkpoint
    directory, "embedded" / "embedded-sdar" / "embedded-chain" (the shipped small models), or a hub id
    (converted once)."""
    return multihost.load(resolve_checkpoint(path), dtype=dtype, verify=verify, mesh=mesh)


def generate(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), rng: jax.Array | None = None, *,
             trace: bool = False, mesh=None, devices=None, slots: int | None = None) -> Generation:
    """Decode a batch of left-padded prompts (ids [B, Lp], mask [B, Lp]) with one compiled loop.

    `model`: an `ll.Model` (or anything with `config`, `denoiser` and `special`). `trace=True` also returns
    `out.trace` (localleap_jax.trace). `mesh` runs on a (data, model) mesh; `devices`, a list of local
    devices, splits the batch over them (pmap). `slots=S` (continuous batching): the loop holds S rows and a
    finished row's slot takes the next prompt, so N > S prompts run in one program, outputs in prompt order
    (`localleap_jax.decode.slots`). See `localleap_jax.decode.run.generate` for the costs."""
    if mesh is not None and devices is not None:
        raise DecodeError("pass mesh= or devices=, not both (a mesh already names its devices)")
    if mesh is not None:
        return generate_sharded(model, ids, mask, cfg, mesh, rng=rng, trace=trace, slots=slots)
    if devices is not None:
        return generate_parallel(model, ids, mask, cfg, rng, devices=devices, trace=trace, slots=slots)
    return generate_on_one_device(model, ids, mask, cfg, rng, trace=trace, slots=slots)


def loglikelihood(model, contexts, continuations, lcfg: LikelihoodConfig = LikelihoodConfig(), *, mesh=None,
                  progress: bool = False, greedy: bool = False):
    """One Monte-Carlo estimate of log p(continuation | context) per request: np.ndarray [N] float64.

    `contexts`, `continuations`: lists of token-id lists (`localleap_jax.likelihood.encode_pair` splits text as
    the authors do). The family's own estimator (LLaDA's for LLaDA, Dream's for Dream) unless
    `lcfg.estimator` names one; see `LikelihoodConfig`. `mesh` splits the requests over "data" and the weights
    over "model"; `progress` shows a bar; `greedy=True` returns LLaDA's is-greedy flags [N] bool instead."""
    from jax.sharding import Mesh

    if mesh is not None and not isinstance(mesh, Mesh):
        raise DecodeError(f"mesh must be a jax Mesh (localleap_jax.partition.make_mesh(data=..., model=...)), got "
                          f"{type(mesh).__name__}")
    placement = None if mesh is None else LikelihoodOnMesh(mesh)
    on_group = bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(contexts), desc="greedy check" if greedy else "loglikelihood", dynamic_ncols=True)
        on_group = lambda group, values, seconds: bar.update(len(group))  # noqa: E731
    try:
        score = greedy_match if greedy else loglikelihood_on
        return score(model, contexts, continuations, lcfg, placement=placement, on_group=on_group)
    finally:
        if bar is not None:
            bar.close()
