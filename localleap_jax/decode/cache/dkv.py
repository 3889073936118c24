"""dKV-Cache-Decode (`dkv`: horseee/dKV-Cache @ 49a76fc, `llada_dkv_cache_decode.py`, the LLaDA model's
`LLaDALlamaBlock.forward`): delayed caching of decoded tokens' K/V, reloaded every `reload_every` passes of a block.

Per row, with i the row's pass index in its block (0, 1, ...):
  - i = 0, i = 1, and i > 1 with i % reload_every == 0: a whole-canvas pass; from i = 1 on it stores every position's
    K/V (the authors store only the positions decoded at the pass's input; the others, masks, are recomputed by
    every pass until they are decoded, so what is stored for them is never read). i = 0 stores nothing in theirs;
    here it does, and pass 1 overwrites it before anything reads it.
  - any other pass runs, through every layer, the positions that were NOT decoded at the previous pass's input:
    every mask of the generated region (later blocks' too) and what the previous pass committed; every other
    position's K/V come from the cache. The recomputed positions' K/V are written back: a token committed by pass j
    is recomputed with its own embedding by pass j + 1, and read from the cache from pass j + 2 on (delayed caching).
    With a logits shift (Dream) the position before each of them runs too (its hidden state predicts it): a position
    is read from the cache once it and the one after it were decoded at the previous pass's input (the authors'
    Dream code's "un" shift type).
Only the recomputed positions have hidden states; the block's masks are always among them. So a rule that reads the
block's decoded positions (one that remasks or edits) is refused.

Each row keeps its own pass index (the loop's step in the block), so it decodes as it does alone; the authors' batch
packs every row's recomputed positions into one rectangle and needs equal counts. The cached passes run at one of a
few static widths (passes.capacities), the smallest that holds every cached row's positions; whole-canvas passes run
in lanes for the rows that take one. `reload_every` is traced per row.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool

from localleap_jax.decode.cache.fast_dllm import refresh_in_lanes, when_else, where_rows
from localleap_jax.decode.cache.passes import capacities, subset_hidden
from localleap_jax.decode.cache.protocol import Hidden, PolicyBase, per_row, setting


class DkvState(NamedTuple):
    kv: object
    decoded: Bool[Array, "B L"]  # what each row held decoded at its last pass's input


@struct.dataclass
class DkvCache(PolicyBase):
    reload_every: int = setting(8, int, low=1)

    name: ClassVar[str] = "dkv"
    computes: ClassVar[str] = "positions (the masks and the last pass's commits)"
    keeps: ClassVar[str] = "kv of decoded positions"
    refreshes: ClassVar[str] = "passes 0, 1 and every reload_every-th of a block"
    whole_block: ClassVar[bool] = False

    def init(self, denoiser, canvas):
        return DkvState(denoiser.empty_cache(canvas.batch, canvas.length), canvas.x0 != canvas.mask_id)

    def full_pass(self, view):
        """Rows whose pass is a whole-canvas one (the block's passes 0 and 1, and the reloads)."""
        i = view.step
        return ~view.done & ((i <= 1) | (i % jnp.maximum(per_row(self.reload_every, i), 1) == 0))

    def recomputed(self, canvas, decoded):
        """The positions a cached pass runs: those not decoded at the previous pass's input (and with a logits shift
        the position before each)."""
        marked = ~decoded
        if canvas.shift:
            marked = marked | jnp.concatenate([marked[:, 1:], jnp.zeros_like(marked[:, :1])], axis=1)
        return marked

    def forward(self, denoiser, canvas, x, block, state, view):
        full = self.full_pass(view)
        h_full, _, kv = refresh_in_lanes(denoiser, canvas, x, block, full, state.kv, False)
        cached = ~view.done & ~full
        marked = self.recomputed(canvas, state.decoded) & cached[:, None]
        widths = capacities(canvas.length, canvas.block_length + canvas.shift)

        def run(kv):
            return subset_hidden(denoiser, canvas, x, marked, block.idx - canvas.shift, kv, store=True,
                                 name=self.name, widths=widths)

        h_cached, kv = when_else(jnp.any(cached), run, kv)
        return Hidden(where_rows(full, h_full, h_cached), None, state._replace(kv=kv), full=full)

    def update(self, denoiser, state, outcome):
        working = outcome.step.working[:, None]
        return state._replace(decoded=jnp.where(working, outcome.before != outcome.canvas.mask_id, state.decoded))
