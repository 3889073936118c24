"""Stop policies: whether a row whose block just filled ends there, before its last block.

    stop_here, x = policy.update(x, block, block_full, last_block, special, counted)

`block` is the row's current block after this step's commits; `counted` [B, T] marks its positions whose tokens the
rule decoded (not the prompt's tail in a block-diffusion row's first block, not a free token: loop.py); a policy may
also write the canvas (early stop fills what follows with EOS). A row whose last block fills always ends; a policy only ends rows earlier.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from localleap_jax.decode.canvas import Block
from localleap_jax.denoiser import SpecialIds


class StopPolicy(Protocol):
    def update(self, x: Int[Array, "B L"], block: Block, block_full: Bool[Array, "B"], last_block: Bool[Array, "B"],
               special: SpecialIds, counted: Bool[Array, "B T"]) -> tuple[Bool[Array, "B"], Int[Array, "B L"]]: ...


@dataclasses.dataclass(frozen=True)
class NeverStop:
    """Rows run to their last block (the default)."""

    def update(self, x, block, block_full, last_block, special, counted):
        return jnp.zeros_like(block_full), x


@dataclasses.dataclass(frozen=True)
class StopAtEos:
    """LLaDA's early stop: a full block holding an EOS the rule decoded ends the row, and every position after it
    becomes EOS. An EOS of the prompt's tail (a block-diffusion row's first block: LLaDA2's authors search
    x[P:block end]) or a free token (Fast-dLLM v2's authors stop on committed tokens only) is not one."""

    def update(self, x, block, block_full, last_block, special, counted):
        generated_eos = (block.tokens == special.eos) & counted
        stop_here = block_full & jnp.any(generated_eos, axis=1) & ~last_block
        after = jnp.arange(x.shape[1])[None, :] >= (block.starts + block.tokens.shape[1])[:, None]
        return stop_here, jnp.where(stop_here[:, None] & after, special.eos, x)


@dataclasses.dataclass(frozen=True)
class EndAtEos:
    """A uniform-noise canvas model's rows end on EOS (transformers' DiffusionGemma generate: its EosTokenCriteria
    over each finished canvas, then pad after the EOS): a finished canvas holding any of `ids` ends its row, and
    every position after the first of them becomes `pad` (the canvases after it too, which the row never decodes).
    A canvas ends when its rule says (not when a mask fills), so this is not the masked loop's early stop: it
    always applies."""

    ids: tuple[int, ...]
    pad: int

    def update(self, x, block, block_full, last_block, special, counted):
        is_end = jnp.isin(block.tokens, jnp.asarray(self.ids, block.tokens.dtype)) & counted
        stop_here = block_full & jnp.any(is_end, axis=1)
        first = block.starts + jnp.argmax(is_end, axis=1)
        after = jnp.arange(x.shape[1])[None, :] > first[:, None]
        return stop_here, jnp.where(stop_here[:, None] & after, self.pad, x)


@dataclasses.dataclass(frozen=True)
class StopAny:
    """A row stops where any of `policies` stops it; their canvas writes apply in order."""

    policies: tuple = ()

    def update(self, x, block, block_full, last_block, special, counted):
        stop_here = jnp.zeros_like(block_full)
        for policy in self.policies:
            stops, x = policy.update(x, block, block_full, last_block, special, counted)
            stop_here |= stops
        return stop_here, x
