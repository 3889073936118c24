"""A uniform-noise canvas model's cache (`encoder`, DiffusionGemma): its encoder's K/V and the self-conditioning input
carried from pass to pass."""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from localleap_jax.decode.cache.protocol import Hidden, PolicyBase
from localleap_jax.decode.canvas import rows_take


class CanvasCacheState(NamedTuple):
    encoder: Any  # the denoiser's encoder cache: prompt and finished canvases, a static-shape K/V buffer per row
    soft: Float[Array, "B C D"]  # each row's self-conditioning input for its next pass (no_soft on a canvas's first)
    encoded: Int[Array, "B"]  # canvases each row has encoded (its K/V holds its prompt and these)


@struct.dataclass
class CanvasEncoderCache(PolicyBase):
    """A uniform-noise canvas model's cache (DiffusionGemma, a `CanvasDenoiser`; the one policy of a canvas rule).

    The encoder's K/V of each row's prompt (encoded once, by `init`) and of its finished canvases, in a buffer of
    static shape; the decoder runs the row's current canvas over it. A row's first pass in a canvas after its first
    also encodes its finished canvas (the argmax canvas the loop kept) before the decoder runs: those passes run the
    encoder over the batch, for the rows that start (a `lax.cond`: passes where no row starts run the decoder
    alone). Beside the K/V the policy keeps each row's self-conditioning input: after a pass, `update` makes it from
    the pass's temperature-scaled logits (none for a row whose canvas just finished: its next pass starts one).
    Rows advance on their own."""

    name: ClassVar[str] = "encoder"
    fits: ClassVar[tuple[str, ...]] = ("canvas",)
    computes: ClassVar[str] = "canvas (the decoder), the finished canvas (the encoder, at a canvas start)"
    keeps: ClassVar[str] = "encoder kv, self-conditioning input"
    refreshes: ClassVar[str] = "never (exact)"

    def init(self, denoiser, canvas):
        B, P = canvas.batch, canvas.prompt_length
        encoder = denoiser.encode(denoiser.empty_cache(B, canvas.length), canvas.x0[:, :P], canvas.key_mask[:, :P])
        return CanvasCacheState(encoder, denoiser.no_soft(B, canvas.block_length), jnp.zeros((B,), jnp.int32))

    def refill(self, denoiser, canvas, state, rows):
        def prefill(st: CanvasCacheState):  # the new prompts, encoded into the slots that take them only
            P = canvas.prompt_length
            encoder = denoiser.encode(denoiser.restart(st.encoder, rows), canvas.x0[:, :P], canvas.key_mask[:, :P],
                                      rows)
            soft = jnp.where(rows[:, None, None], denoiser.no_soft(canvas.batch, canvas.block_length), st.soft)
            return CanvasCacheState(encoder, soft, jnp.where(rows, 0, st.encoded))
        return jax.lax.cond(jnp.any(rows), prefill, lambda st: st, state)

    def forward(self, denoiser, canvas, x, block, state, view):
        T = canvas.block_length
        current = (block.starts - canvas.first_start) // T  # each row's canvas index
        encodes = ~view.done & view.starting & (view.block > 0)  # rows starting a canvas after their first

        def encode_finished(st: CanvasCacheState):
            rows = ~view.done & (st.encoded < current)
            kept = rows_take(x, block.idx - T)  # the canvas before: what the loop kept of it
            encoder = denoiser.encode(st.encoder, kept, jnp.ones(kept.shape, bool), rows)
            return st._replace(encoder=encoder, encoded=jnp.where(rows, st.encoded + 1, st.encoded))

        state = jax.lax.cond(jnp.any(encodes), encode_finished, lambda st: st, state)
        return Hidden(denoiser.decode(state.encoder, block.tokens, state.soft), None, state, full=encodes)

    def update(self, denoiser, state: CanvasCacheState, outcome) -> CanvasCacheState:
        """The state for the next pass: each row's self-conditioning input from this pass's temperature-scaled
        logits (the step's `feed`: logits and weight), none (weight 0) where the row's canvas just finished."""
        scaled, weight = outcome.step.feed
        soft = denoiser.soft_embedding(scaled)
        soft = jnp.where(weight[..., None] > 0, weight[..., None].astype(soft.dtype) * soft, jnp.zeros((), soft.dtype))
        return state._replace(soft=soft.astype(state.soft.dtype))
