"""The front door: `ll.load`, `ll.generate`, `ll.loglikelihood` and `ll.lower_generate`, which choose where the work
runs.

    model = ll.load(path, dtype="bfloat16", verify=True, mesh=None)
    out = ll.generate(model, ids, mask, cfg, rng, trace=False, mesh=None, devices=None, slots=None)
    logp = ll.loglikelihood(model, contexts, continuations, ll.LikelihoodConfig(), mesh=None)
    lowered = ll.lower_generate(config, cfg, batch=8, prompt_length=896, dtype="bfloat16", topology=None, mesh=None)

`load` is three steps: resolve the name (an embedded model, a directory, or a hub id converted once), open the
directory (manifest.json and config.json read once), restore the parameters (onto one device, or straight into
the mesh's shards); with several processes every process loads at once and all raise if any fails.
`generate` runs on one device by default; with `devices` (several local devices) the batch is split over them
with a full copy of the weights on each (pmap); with `mesh` (`ll.make_mesh(data=, model=)`) the batch is split
over "data" and the weights over "model". Every choice gives the same tokens (`localleap_jax.dist.placement`).
A multi-process run's leader sends each call to the other processes first (`localleap_jax.dist.multihost`).
"""

from __future__ import annotations

import jax
import numpy as np

from localleap_jax import checkpoint
from localleap_jax.checkpoint import Model
from localleap_jax.decode import DecodeConfig, Generation, run
from localleap_jax.dist import aot
from localleap_jax.dist.placement import decode_placement, likelihood_placement
from localleap_jax.errors import CheckpointError
from localleap_jax.likelihood import LikelihoodConfig, LikelihoodError, greedy_match, loglikelihood as loglikelihood_on
from localleap_jax.processes import all_succeed
from localleap_jax.resolve import resolve_checkpoint


def load(path, dtype="bfloat16", verify: bool = True, mesh=None) -> Model:
    """Restore a checkpoint (see `localleap_jax.checkpoint.load`): into `dtype`, on one device or, with `mesh`,
    straight into each parameter's shards; on several processes, every process at once (a step that fails on one
    fails on all, so none waits). `path`: a checkpoint directory, "embedded" / "embedded-sdar" / "embedded-dg" /
    "embedded-chain" (the shipped small models), or a hub id (converted once)."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise CheckpointError(f"mesh must be a jax Mesh (ll.make_mesh(data=..., model=...)), got {type(mesh).__name__}")
    if not isinstance(verify, (bool, np.bool_)):
        raise CheckpointError(f"verify={verify!r} must be True or False")
    return checkpoint.load(resolve_checkpoint(path), dtype, verify, mesh,
                           agree=lambda step, what: all_succeed(step, CheckpointError, what))


def generate(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), rng: jax.Array | None = None, *,
             trace: bool = False, mesh=None, devices=None, slots: int | None = None, canvas_noise=None) -> Generation:
    """Decode a batch of left-padded prompts (ids [B, Lp], mask [B, Lp]) with one compiled loop.

    `model`: an `ll.Model` (or anything with `config`, `denoiser` and `special`). `trace=True` also returns
    `out.trace` (localleap_jax.trace). `mesh` runs on a (data, model) mesh; `devices`, a list of local
    devices, splits the batch over them (pmap). `slots=S` (continuous batching): the loop holds S rows and a
    finished row's slot takes the next prompt, so N > S prompts run in one program, outputs in prompt order
    (`localleap_jax.decode.slots`). `canvas_noise` [B, J, N + 1, C]: a canvas rule's uniform draws, supplied
    (`localleap_jax.decode.draws`: a prompt's draws are its own on every placement). See `localleap_jax.decode.run.generate` for the costs."""
    return run(model, ids, mask, cfg, rng, placement=decode_placement(mesh, devices), trace=trace, slots=slots,
               canvas_noise=canvas_noise)


def loglikelihood(model, contexts, continuations, lcfg: LikelihoodConfig = LikelihoodConfig(), *, mesh=None,
                  progress: bool = False, greedy: bool = False):
    """One Monte-Carlo estimate of log p(continuation | context) per request: np.ndarray [N] float64.

    `contexts`, `continuations`: lists of token-id lists (`localleap_jax.likelihood.encode_pair` splits text as
    the authors do). The family's own estimator (LLaDA's for LLaDA, Dream's for Dream) unless
    `lcfg.estimator` names one; see `LikelihoodConfig`. `mesh` splits the requests over "data" and the weights
    over "model"; `progress` shows a bar; `greedy=True` returns LLaDA's is-greedy flags [N] bool instead."""
    missing = [a for a in ("config", "denoiser") if not hasattr(model, a)]
    if missing:
        raise LikelihoodError(f"loglikelihood takes a model (an ll.Model from ll.load); {type(model).__name__} has no "
                              f"{', '.join(missing)}")
    placement = likelihood_placement(mesh)
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


def lower_generate(config, cfg: DecodeConfig, *, batch: int, prompt_length: int, dtype="bfloat16", topology=None,
                   mesh=None, trace: bool = False, slots: int | None = None):
    """The whole generation program `ll.generate` runs, lowered from a `ModelConfig` alone (no weights, no devices
    held): `jax.stages.Lowered` for `batch` prompts of `prompt_length` tokens under `cfg`, parameters of `dtype`.
    `topology=None`: this host's backend; a TPU topology name ("v5e:2x4", "v6e:2x2", "v5p:2x2x1") compiles for those
    chips on any host (libtpu: the `[tpu-aot]` extra). `mesh=dict(data=, expert=, model=)`: split as `ll.generate`
    on `ll.make_mesh(...)` splits it. `.compile()` it for `memory_analysis()`, `cost_analysis()` and `as_text()`
    (`localleap_jax.hlo_bytes` counts the bytes a pass moves; `python -m localleap_jax.plan` prints it all)."""
    return aot.lower_generate(config, cfg, batch=batch, prompt_length=prompt_length, dtype=dtype, topology=topology,
                              mesh=mesh, trace=trace, slots=slots)
