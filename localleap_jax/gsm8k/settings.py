"""The settings of an evaluation, beside the model and the strategies: the canvas, the rules' shared
settings, the prompts, batching and devices, with the model's own defaults for what is not given."""

from __future__ import annotations

import dataclasses
from typing import Any

from localleap_jax.decode import DecodeConfig, model_canvas
from localleap_jax.families import family_of
from localleap_jax.rules import with_shared_settings

DEFAULTS = {"gen_length": 256, "block_length": 32, "num_fewshot": 5}  # the papers' GSM8K setting
DEFAULT_STRATEGIES = "low_confidence,threshold,localleap"  # before the model is known; then its family's


def model_defaults(manifest: dict, config=None) -> dict:
    """A checkpoint's evaluation defaults: its manifest's `eval_defaults` over the papers' setting (the
    embedded model's own canvas is smaller), with what the model fixes (`config`, the ModelConfig, when known;
    `decode.model_canvas`): a block-diffusion model's block is its block_size; a uniform-noise canvas model's
    (DiffusionGemma) is its canvas_length, and gen_length the papers' 256 rounded up to whole canvases."""
    own = {k: v for k, v in manifest.get("eval_defaults", {}).items() if k != "strategies"}
    fixed = model_canvas(config, own.get("gen_length", DEFAULTS["gen_length"]))
    return {**DEFAULTS, **fixed, **own}


def default_strategies(config=None, manifest: dict | None = None) -> str:
    """The --strategies of a run that names none: the checkpoint's own (its manifest's
    `eval_defaults.strategies`), else the family's; the baseline first (the ratios' denominator)."""
    own = (manifest or {}).get("eval_defaults", {}).get("strategies")
    if own:
        return own
    return family_of(config).eval_strategies if config is not None else DEFAULT_STRATEGIES


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What every strategy of one evaluation is run with (the command lines' flags of the same names)."""

    gen_length: int
    block_length: int
    num_fewshot: int
    batch_size: int
    slots: int | None = None  # continuous batching: rows the loop holds (None: batch_size)
    queue: int | None = None  # prompts per compiled call through the slots (None: 4 x slots; == slots: fixed batches)
    limit: int | None = None  # the first N problems (None: all of them)
    seed: int = 0
    truncate_fewshot: bool = False  # drop few-shot examples from a prompt too long for the model
    early_stop: bool = False
    cache: str = "auto"  # the KV cache mode ("auto": the exact block cache for block diffusion, the encoder's K/V
    # for a uniform-noise canvas model, else none)
    # The rules' shared settings (None: each rule's default; a setting in a rule's spec wins).
    steps: int | None = None
    kappa: float | None = None
    tau: float | None = None
    radius: int | None = None
    compile_cache: bool = True  # JAX's persistent compilation cache
    mesh: Any = None  # the (data, model) mesh to generate on; None: one process, pmap over its devices
    model: Any = None  # the ModelConfig, for the checks that depend on it (a block-diffusion model's grid)

    @classmethod
    def for_model(cls, manifest: dict, *, gen_length: int | None = None, block_length: int | None = None,
                  num_fewshot: int | None = None, model=None, **given: Any) -> EvalSettings:
        """The settings given, with the model's defaults (`model_defaults`) for canvas and few-shot count
        left None."""
        defaults = model_defaults(manifest, model)
        canvas = {"gen_length": gen_length, "block_length": block_length, "num_fewshot": num_fewshot}
        return cls(**{k: defaults[k] if v is None else v for k, v in canvas.items()}, model=model, **given)

    @property
    def mesh_shape(self) -> dict | None:
        return None if self.mesh is None else dict(self.mesh.shape)

    def check(self, strategy: str) -> DecodeConfig:
        """The DecodeConfig of one strategy, validated against the model when it is known."""
        return self.decode_config(strategy).validate(self.model)

    def decode_config(self, strategy: str) -> DecodeConfig:
        """The DecodeConfig of one strategy under these settings (not validated yet)."""
        rule = with_shared_settings(strategy, kappa=self.kappa, tau=self.tau, radius=self.radius, steps=self.steps)
        return DecodeConfig(strategy=rule, gen_length=self.gen_length, block_length=self.block_length,
                            early_stop=self.early_stop, cache=self.cache)
