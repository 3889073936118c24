"""The settings of an evaluation, beside the model and the strategies: the canvas, the rules' shared
settings, the prompts, batching and devices, with the model's own defaults for what is not given."""

from __future__ import annotations

import dataclasses
from typing import Any

from localleap_jax.decode import DecodeConfig

DEFAULTS = {"gen_length": 256, "block_length": 32, "num_fewshot": 5}  # the papers' GSM8K setting


def model_defaults(manifest: dict) -> dict:
    """A checkpoint's evaluation defaults: its manifest's `eval_defaults` over the papers' setting (the
    embedded model's own canvas is smaller)."""
    return {**DEFAULTS, **manifest.get("eval_defaults", {})}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What every strategy of one evaluation is run with (the command lines' flags of the same names)."""

    gen_length: int
    block_length: int
    num_fewshot: int
    batch_size: int
    limit: int | None = None  # the first N problems (None: all of them)
    seed: int = 0
    truncate_fewshot: bool = False  # drop few-shot examples from a prompt too long for the model
    early_stop: bool = False
    cache: str = "none"  # the KV cache mode
    # The rules' shared settings (None: each rule's default; a setting in a rule's spec wins).
    steps: int | None = None
    kappa: float | None = None
    tau: float | None = None
    radius: int | None = None
    compile_cache: bool = True  # JAX's persistent compilation cache
    mesh: Any = None  # the (data, model) mesh to generate on; None: one process, pmap over its devices

    @classmethod
    def for_model(cls, manifest: dict, *, gen_length: int | None = None, block_length: int | None = None,
                  num_fewshot: int | None = None, **given: Any) -> EvalSettings:
        """The settings given, with the model's defaults (`model_defaults`) for canvas and few-shot count
        left None."""
        defaults = model_defaults(manifest)
        canvas = {"gen_length": gen_length, "block_length": block_length, "num_fewshot": num_fewshot}
        return cls(**{k: defaults[k] if v is None else v for k, v in canvas.items()}, **given)

    @property
    def mesh_shape(self) -> dict | None:
        return None if self.mesh is None else dict(self.mesh.shape)

    def decode_config(self, strategy: str) -> DecodeConfig:
        """The DecodeConfig of one strategy under these settings (not validated yet)."""
        return DecodeConfig(strategy=strategy, gen_length=self.gen_length, block_length=self.block_length,
                            kappa=self.kappa, tau=self.tau, radius=self.radius, steps=self.steps,
                            early_stop=self.early_stop, cache=self.cache)
