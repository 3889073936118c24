"""`Model`: a loaded checkpoint, everything generation needs: the architecture, its family, its weights, its tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp

from localleap_jax.config import ModelConfig
from localleap_jax.denoiser import Denoiser, SpecialIds
from localleap_jax.families import Family, decoding_params, denoiser_of, family_of
from localleap_jax.model import Params
from localleap_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Model:
    """Everything generation needs: the architecture, its weights and its tokenizer."""

    config: ModelConfig
    params: Params  # in the decoding layout (one array per layer: model.py's docstring), whatever was given
    tokenizer: Tokenizer
    path: Path | None = None

    def __post_init__(self):
        # Split once here, so every pass reads each layer's weights where they lie (a stacked tree given by a caller
        # is copied once; `checkpoint.load` hands over a tree already split, its stacked leaves freed).
        object.__setattr__(self, "params", decoding_params(self.params, self.config))

    @property
    def family(self) -> Family:
        """The family record (how its config.json and tensors are named, its likelihood estimator, ...)."""
        return family_of(self.config)

    @property
    def dtype(self) -> jnp.dtype:
        import jax

        return jax.tree.leaves(self.params)[0].dtype

    @property
    def denoiser(self) -> Denoiser:
        """What the decode loop runs (the parameters and the config: model.py's pure functions, or the family's)."""
        return denoiser_of(self.params, self.config)

    @property
    def special(self) -> SpecialIds:
        """The ids the decode loop treats specially: mask and EOS from the config, EOT and the decodable ids
        from the tokenizer."""
        return SpecialIds.of(self.config, self.tokenizer)
