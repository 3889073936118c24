"""Stop policies: whether a row whose block just filled ends there, before its last block.

    stop_here, x = policy.update(x, block, block_full, last_block, special, prompt_length)

`block` is the row's current block after this step's commits (on a block-diffusion grid the first one may hold
the prompt's tail: canvas positions < `prompt_length`); a policy may also write the canvas (early stop fills what
follows with EOS). A row whose last block fills always ends; a policy only ends rows earlier.
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
               special: SpecialIds, prompt_length: int) -> tuple[Bool[Array, "B"], Int[Array, "B L"]]: ...


@dataclasses.dataclass(frozen=True)
class NeverStop:
    """Rows run to their last block (the default)."""

    def update(self, x, block, block_full, last_block, special, prompt_length):
        return jnp.zeros_like(block_full), x


@dataclasses.dataclass(frozen=True)
class StopAtEos:
    """LLaDA's early stop: a full block holding a generated EOS ends the row, and every position after it becomes EOS
    (an EOS of the prompt's tail, in a block-diffusion row's first block, is not one: LLaDA2's authors search
    x[P:block end])."""

    def update(self, x, block, block_full, last_block, special, prompt_length):
        generated_eos = (block.tokens == special.eos) & (block.idx >= prompt_length)
        stop_here = block_full & jnp.any(generated_eos, axis=1) & ~last_block
        after = jnp.arange(x.shape[1])[None, :] >= (block.starts + block.tokens.shape[1])[:, None]
        return stop_here, jnp.where(stop_here[:, None] & after, special.eos, x)


@dataclasses.dataclass(frozen=True)
class StopAny:
    """A row stops where any of `policies` stops it; their canvas writes apply in order."""

    policies: tuple = ()

    def update(self, x, block, block_full, last_block, special, prompt_length):
        stop_here = jnp.zeros_like(block_full)
        for policy in self.policies:
            stops, x = policy.update(x, block, block_full, last_block, special, prompt_length)
            stop_here |= stops
        return stop_here, x
