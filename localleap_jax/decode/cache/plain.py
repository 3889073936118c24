"""Every pass runs the whole canvas: no cache (`none`), WINO's probed pass (`none+probe`) and dInfer's iteration
smoothing's pass with a soft input (`none+soft`)."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
from flax import struct

from localleap_jax.decode.cache.protocol import Hidden, PolicyBase, from_full


@struct.dataclass
class NoCache(PolicyBase):
    """Every pass runs the whole canvas; rows advance through blocks on their own."""

    name: ClassVar[str] = "none"
    fits: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")
    region: ClassVar[bool] = True

    def forward(self, denoiser, canvas, x, block, state, view):
        h_all, _ = denoiser.full(x, canvas.positions, canvas.key_mask)
        return Hidden(*from_full(h_all, canvas, block, view.want_region), (), full=~view.done)


@struct.dataclass
class ProbedNoCache(NoCache):
    """Every pass runs the whole canvas and, in the same forward pass, a probe copy of the block
    (`Denoiser.probe`): hidden states that score each block position with that position hidden (WINO's
    verification). Cost: T more queries and keys per pass (L + T instead of L) under an explicit attention mask
    (XLA's attention path, never cuDNN's)."""

    name: ClassVar[str] = "none+probe"
    fits: ClassVar[tuple[str, ...]] = ("bidirectional",)

    def forward(self, denoiser, canvas, x, block, state, view):
        h_all, held_out = denoiser.probe(x, canvas.positions, canvas.key_mask, block.idx, canvas.mask_id)
        h_block, h_region = from_full(h_all, canvas, block, view.want_region)
        return Hidden(h_block, h_region, (), held_out, full=~view.done)


@struct.dataclass
class SoftNoCache(NoCache):
    """Every pass runs the whole canvas with a soft input added to the generated region's token embeddings: the one
    the previous pass left (none before a row's first pass). The state is that input, [B, G, D] in the embedding's
    dtype (G x D x 2 bytes a row in bf16: 2 MB at G 256, D 4096). The pass reports the hidden states of the whole
    generated region, whose logits make the next input (`update`, from the step's `feed`: logits and weight).

    One mechanism for every policy that carries a soft input (this one, the canvas encoder's self-conditioning): the
    next pass's input is weight x denoiser.soft_embedding(logits), the embedding the pass's distribution expects in
    the denoiser's own form (a masked LM's softmax(logits) @ E, added to its token embeddings)."""

    name: ClassVar[str] = "none+soft"
    fits: ClassVar[tuple[str, ...]] = ("bidirectional",)

    def init(self, denoiser, canvas):
        return denoiser.no_soft(canvas.batch, canvas.length - canvas.prompt_length)

    def refill(self, denoiser, canvas, state, rows):
        return jnp.where(rows[:, None, None], jnp.zeros((), state.dtype), state)

    def forward(self, denoiser, canvas, x, block, state, view):
        P = canvas.prompt_length
        soft = jnp.concatenate([jnp.zeros((canvas.batch, P, state.shape[-1]), state.dtype), state], axis=1)
        h_all, _ = denoiser.full(x, canvas.positions, canvas.key_mask, soft)
        return Hidden(*from_full(h_all, canvas, block, True), state, full=~view.done)

    def update(self, denoiser, state, outcome):
        logits, weight = outcome.step.feed  # [B, G, V], [B, G]: weight 0 where no input
        soft = denoiser.soft_embedding(logits)
        return (weight[..., None].astype(soft.dtype) * soft).astype(state.dtype)
