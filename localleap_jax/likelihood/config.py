"""What a likelihood evaluation is asked for: the Monte-Carlo budget, guidance, the seed and the estimator."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from localleap_jax.errors import LikelihoodError


ESTIMATOR_NAMES = ("llada", "dream")


@dataclasses.dataclass(frozen=True)
class LikelihoodConfig:
    """Settings of `ll.loglikelihood` (defaults: LLaDA's `eval_llada.py`).

    mc_num: Monte-Carlo samples per request, drawn in `mc_num / batch_size` mini-batches of `batch_size`
        rows (the authors' mini-batch: LLaDA stratifies its mask counts across the rows of one mini-batch,
        Dream its mask rates).
    cfg_scale: classifier-free guidance w, LLaDA's convention for every family: logits
        `un + (w + 1) (cond - un)`, the unconditional copy with every context token replaced by the mask id;
        0 is off. (Dream's `classifier_free_guidance=g` is w = g - 1.)
    seed: each request's noise comes from a key folded from the seed and the request's own token ids, so its
        estimate does not depend on the batch it is in, nor on the order of the requests.
    estimator: "llada" (exactly l ~ stratified U{1..L} continuation tokens masked, weight L / l) or "dream"
        (each continuation token masked with p = (1 - eps) t + eps, weight 1 / p, the final token never);
        None: the model family's own (LLaDA's for LLaDA, Dream's for Dream).
    sampling_eps: Dream's eps.
    requests_per_call: requests estimated together by one compiled call (the last group is filled up with
        copies, which are dropped); a throughput knob that never changes a number.
    """

    mc_num: int = 128
    batch_size: int = 32
    cfg_scale: float = 0.0
    seed: int = 0
    estimator: str | None = None
    sampling_eps: float = 1e-3
    requests_per_call: int = 4

    def __post_init__(self):
        self.validate()  # settings are checked when made: one line here, not inside loglikelihood

    def validate(self) -> "LikelihoodConfig":
        bad = []
        for name in ("mc_num", "batch_size", "requests_per_call"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                bad.append(f"{name}={value!r} must be a positive integer")
        if not bad and self.mc_num % self.batch_size:
            bad.append(f"mc_num={self.mc_num} must be a multiple of batch_size={self.batch_size} "
                       "(the samples are drawn in whole mini-batches, as the authors draw them)")
        if isinstance(self.cfg_scale, bool) or not isinstance(self.cfg_scale, (int, float, np.integer, np.floating)) \
                or not math.isfinite(self.cfg_scale) or self.cfg_scale < 0:
            bad.append(f"cfg_scale={self.cfg_scale!r} must be a finite number >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**32:
            bad.append(f"seed={self.seed!r} must be an integer in [0, 2**32)")
        if self.estimator is not None and self.estimator not in ESTIMATOR_NAMES:
            bad.append(f"estimator={self.estimator!r} is not one of {', '.join(ESTIMATOR_NAMES)} (or None)")
        if not isinstance(self.sampling_eps, (int, float)) or not 0 < self.sampling_eps < 1:
            bad.append(f"sampling_eps={self.sampling_eps!r} must lie in (0, 1)")
        if bad:
            raise LikelihoodError("LikelihoodConfig: " + "; ".join(bad))
        return self

    @property
    def mc_batches(self) -> int:
        return int(self.mc_num) // int(self.batch_size)

    def to_json(self) -> dict:
        return {k: v.item() if isinstance(v, np.generic) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, record: dict) -> "LikelihoodConfig":
        return cls(**record)
