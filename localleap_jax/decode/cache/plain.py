"""Every pass runs the whole canvas: no cache (`none`), and WINO's probed pass (`none+probe`)."""

from __future__ import annotations

from typing import ClassVar

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
