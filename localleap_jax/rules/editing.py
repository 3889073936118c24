"""Rules that edit: besides committing masks, they replace a held generated token by a different prediction.

JointThreshold is LLaDA2.1's decoding ("M2T + T2T": mask-to-token commits and token-to-token edits) as SGLang
serves it. It returns `Decision(commit, edit=..., finished=...)` (see `base`): the loop applies the commits and
the edits (only where a generated token is held and the prediction differs; never the prompt) and ends a row's
block on the pass the rule says, once no mask is left. `oracles.joint_threshold` is the eager transcription the
tests compare with (batch 1, greedy).
"""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct

from localleap_jax.rules.base import Decision, RuleBase, Signals, first_clause, most_confident, per_row, setting
from localleap_jax.rules.registry import register_rule


@register_rule("joint_threshold")
@struct.dataclass
class JointThreshold(RuleBase):
    """SGLang's JointThreshold (sgl-project/sglang `python/sglang/srt/dllm/algorithm/joint_threshold.py`, the
    stateful `step` of 17d57211 driven by `base.py`'s `_run_sync`), LLaDA2.1's editing decoder. Per row and pass,
    with `pred` / `conf` the prediction and its probability at every position of the block:

      masks left   commit the masks with conf > threshold (strict; clause "threshold"); none: the single most
                   confident mask ("top1")
      no mask      a post-edit pass: the row's count of them goes up by one; the pass that takes it past
                   max_post_edit_steps ends the block and changes nothing
      edits        in the same pass, masks left or not: every position holding a generated token (not a mask, not
                   the prompt: the prompt's tail in a block-diffusion row's first block is never edited) whose
                   prediction differs from it with conf > edit_threshold (strict: 0 edits every disagreement)
      block end    on the first pass that commits and edits nothing, or the budget's pass above

    NFE counts every pass, the one that ends the block included (it changes nothing) and the one on which the
    budget runs out; not SGLang's extra forward that stores a finished block's K/V (as SDAR's store pass is not
    counted here: the exact block cache stores it in the next block's first pass). A row takes at most
    block_length mask passes per block (each commits at least one mask), then at most max_post_edit_steps + 1:
    `pass_bound` is blocks x (block_length + max_post_edit_steps + 1).

    Defaults are SGLang's documented setting ("S mode": 0.5 / 0.0 / 16); diffusers' example uses 0.7 / 0.5 / 16
    ("Q mode"). Differences from diffusers' LLaDA2 scheduler, which this rule does not follow: it runs a
    (max_post_edit_steps + 1)-th mask-free pass that still edits; it runs no editing pass after the pass that fills
    the last mask; edit_threshold <= 0 disables editing there (here, as in SGLang, 0 edits every disagreement);
    its stop conditions are shared by the batch's rows (here each row ends its own blocks).

    The loop never predicts the mask token (nor ids the tokenizer cannot decode); SGLang's argmax may (an edit
    that writes the mask back, a commit that leaves one): the tests give the oracle the same exclusion. Caches:
    the rows must advance on their own, so cache "none" on a bidirectional model (LLaDA, blocks of the generated
    region), "block" (exact, what "auto" picks) or "none" on a block-diffusion model (SDAR, LLaDA2).
    """

    threshold: float = setting(0.5, low=0.0, high=1.0)
    edit_threshold: float = setting(0.0, low=0.0, high=1.0)
    max_post_edit_steps: int = setting(16, int, low=0)
    clause_names = ("threshold", "top1")
    edit_names: ClassVar[tuple[str, ...]] = ("changed",)
    ends_blocks: ClassVar[bool] = True

    def init(self, batch, block, vocab):
        return jnp.zeros((batch,), jnp.int32)  # post-edit passes in the row's current block

    def update(self, s: Signals, post_edit):
        masks_left = jnp.any(s.candidates, axis=1)
        over = s.candidates & (s.conf > per_row(self.threshold))
        commit = first_clause(over, most_confident(s.conf, s.candidates) & ~jnp.any(over, axis=1, keepdims=True))
        post_edit = post_edit + (~masks_left).astype(jnp.int32)
        budget_spent = ~masks_left & (post_edit > jnp.asarray(self.max_post_edit_steps, jnp.int32))
        edit = (s.decoded & (s.pred != s.tokens) & (s.conf > per_row(self.edit_threshold))
                & ~budget_spent[:, None])
        changes = jnp.any(commit > 0, axis=1) | jnp.any(edit, axis=1)
        return Decision(commit, edit=edit, finished=budget_spent | ~changes), post_edit

    def pass_bound(self, gen_length, block_length):
        blocks = -(-gen_length // block_length)
        return blocks * (block_length + int(np.max(np.asarray(self.max_post_edit_steps))) + 1)
