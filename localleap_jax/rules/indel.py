"""LLaDA2.2's insert/delete decoding: SGLang's JointThresholdInDel (sgl-project/sglang
`python/sglang/srt/dllm/algorithm/joint_threshold_indel.py` @0fbe7e46, the stateful `step` driven by `base.py`'s
`_run_sync`), a rule that rewrites its block (`rewrites`: `Decision(commit, edit=..., finished=..., block=...,
insert=..., delete=...)`). `oracles/joint_threshold.py` (`joint_threshold_indel_generate`) is the eager
transcription the tests compare with; `../shared/reference/dinfer-decoders.md` lists the rules with line numbers.

Beside the mask and the ordinary tokens the model predicts two edit tokens (config.json's `delete_token_id` and
`split_token_id`): DELETE written at a position drops it, SPLIT written at one inserts a new mask before its OLD
token; the block is then cut (tokens pushed past its end are lost) or padded with new masks back to its length.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

from localleap_jax.rules.base import Decision, DecodeError, RuleBase, Signals, first_clause, per_row, rank_by, setting
from localleap_jax.rules.registry import register_rule


class IndelState(NamedTuple):
    original: Bool[Array, "B T"]  # the position's token descends from a mask there at the block's entry
    post: Int[Array, "B"]  # passes of the block with no original mask left (cumulative)
    updates: Int[Array, "B"]  # passes of the block
    seen: Int[Array, "B H T"]  # the block's tokens at the start of each pass (H: the most passes a block takes)
    written: Int[Array, "B T H"]  # the token each pass wrote at each position (vocab: none), for the anti-loop rule


def rebuild(tokens: Int[Array, "B T"], old: Int[Array, "B T"], original: Bool[Array, "B T"],
            prompt: Bool[Array, "B T"], *, mask_id: int, delete, split) -> tuple[Int[Array, "B T"], Bool[Array, "B T"]]:
    """SGLang's `_apply_edit_operations`, with static shapes: after the prompt (copied from `old`), DELETE drops its
    position, SPLIT becomes [a new mask, the position's OLD token] (which keeps its `original` flag), every other
    token stays; then cut, or padded with new masks, to T. `delete` / `split`: [B] ids."""
    B, T = tokens.shape
    is_delete = ~prompt & (tokens == delete[:, None])
    is_split = ~prompt & (tokens == split[:, None])
    width = jnp.where(is_delete, 0, jnp.where(is_split, 2, 1))  # output positions each input position takes
    ends = jnp.cumsum(width, axis=1)
    q = jnp.arange(T)
    src = jnp.sum(ends[:, None, :] <= q[None, :, None], axis=2)  # [B, T]: the input position output q comes from
    real = q[None, :] < ends[:, -1:]
    src = jnp.minimum(src, T - 1)
    take = lambda a: jnp.take_along_axis(a, src, axis=1)  # noqa: E731
    first_of_split = take(is_split) & (q[None, :] == take(ends - width))
    written = jnp.where(prompt, old, tokens)
    out = jnp.where(take(is_split), jnp.where(first_of_split, mask_id, take(old)), take(written))
    flags = take(original) & ~first_of_split
    return jnp.where(real, out, mask_id), flags & real


@register_rule("joint_threshold_indel")
@struct.dataclass
class JointThresholdInDel(RuleBase):
    """SGLang's JointThresholdInDel @0fbe7e46 (LLaDA2.2). Per row and pass over its block, with x the argmax over
    the WHOLE vocabulary (mask, DELETE and SPLIT included) and p its probability; the "original" masks are those at
    the block's entry (their flags move with their tokens through DELETE and SPLIT), the prompt's tail (a
    block-diffusion row's first block) is never written:
      count      update += 1; post += 1 when no original mask is left (cumulative)
      cleanup    the pass is the block's last when post >= max_post_edit_steps > 0, or max_post_edit_steps == 0 and no
                 original mask is left, or update > block_length + max_post_edit_steps
      fallback   (not cleanup) an original mask whose x is the mask id takes its best other token and its p
      commits    cleanup: every mask ("cleanup"); original masks left: quota 1 + (masks not original): the masks with
                 p > threshold if at least quota of them ("threshold"), else the quota's most confident ("top_k");
                 only introduced masks left: every mask ("introduced"). With max_post_edit_steps 0 the pass that takes
                 the last original masks is the cleanup
      edits      every held token (not a mask, not the prompt) whose x differs with p > edit_threshold (strict)
      nothing    to write: the block ends (the pass counts)
      scrub      (cleanup) a mask, DELETE or SPLIT to write becomes the best other token
      anti-loop  (not cleanup) when the block's tokens at this pass's start were seen at an earlier pass's start, the
                 changing written position with the lowest p (first on ties) takes its best token not yet written at
                 that position in this block (history by position), not the mask id at an original mask
      write      DELETE drops the position, SPLIT inserts a new mask before the old token; cut / padded to the block
      end        after the cleanup pass
    Counted per pass (out.inserts, out.deletes, out.edits): a written SPLIT, a written DELETE, a held token rewritten
    with a different token that is none of mask, DELETE, SPLIT. NFE: the passes up to the one that ends the block,
    not SGLang's extra forward that stores a block the cleanup changed (the exact block cache stores it in the next
    block's first pass). A block takes at most block_length + max_post_edit_steps + 1 passes.

    Ids: delete_token_id / split_token_id, None: the model's (config.json, `ModelConfig.delete_token_id`). Ids past
    the tokenizer's vocabulary are never written (the mask id is). Ties: lowest id (argmax), lowest position (the
    quota's top-k, where torch.topk leaves the order open). Caches: rows advance on their own: "block" (what "auto"
    picks) or "none" on a block-diffusion model (LLaDA2, as SGLang runs it), "none" on a bidirectional one. Greedy
    (SGLang's step is argmax-only): a DecodeConfig.temperature > 0 is not used by its decisions. State
    per row: 2 x block_length x (block_length + max_post_edit_steps + 1) x 4 bytes (12.5 KB at 32 and 16)."""

    threshold: float = setting(0.5, low=0.0, high=1.0)
    edit_threshold: float = setting(0.0, low=0.0, high=1.0)
    max_post_edit_steps: int = setting(16, int, low=0)
    delete_token_id: int | None = setting(None, int, low=0, none_ok=True)
    split_token_id: int | None = setting(None, int, low=0, none_ok=True)
    # the largest max_post_edit_steps of the batch's rows (static: it sizes the state), set by with_rows
    post_bound: int | None = struct.field(pytree_node=False, default=None)
    clause_names = ("threshold", "top_k", "introduced", "cleanup")
    edit_names: ClassVar[tuple[str, ...]] = ("changed",)
    ends_blocks: ClassVar[bool] = True
    rewrites: ClassVar[bool] = True

    def validate(self, gen_length=None, block_length=None):
        super().validate(gen_length, block_length)
        d, s = self.delete_token_id, self.split_token_id
        if d is not None and s is not None and np.any(np.asarray(d) == np.asarray(s)):
            raise DecodeError(f"{self.name}: delete_token_id and split_token_id must differ (both {d})")
        return self

    def with_rows(self, batch):
        rows = super().with_rows(batch)
        return rows.replace(post_bound=int(np.max(np.asarray(self.max_post_edit_steps))))

    def pass_bound(self, gen_length, block_length):
        blocks = -(-gen_length // block_length)
        return blocks * (block_length + int(np.max(np.asarray(self.max_post_edit_steps))) + 1)

    def _history(self, block: int) -> int:
        bound = self.post_bound if self.post_bound is not None else int(np.max(np.asarray(self.max_post_edit_steps)))
        return block + bound + 1

    def init(self, batch, block, vocab):
        H = self._history(block)
        zeros = jnp.zeros((batch,), jnp.int32)
        return IndelState(jnp.zeros((batch, block), bool), zeros, zeros, jnp.full((batch, H, block), -1, jnp.int32),
                          jnp.full((batch, block, H), vocab, jnp.int32))

    def _ids(self, s: Signals):
        ids = []
        for name, given, model in (("delete_token_id", self.delete_token_id, s.delete_id),
                                   ("split_token_id", self.split_token_id, s.split_id)):
            if given is None and model is None:
                raise DecodeError(f"{self.name} writes LLaDA2.2's DELETE and SPLIT tokens: this model's config.json "
                                  f"has no {name}; pass {name}=... to the rule")
            if given is None and model == s.mask_id:
                raise DecodeError(f"{self.name}: the model's {name} is its mask id ({model})")
            ids.append(jnp.broadcast_to(jnp.asarray(model if given is None else given, jnp.int32),
                                        s.candidates.shape[:1]))
        return ids

    def update(self, s: Signals, st: IndelState):
        delete, split = self._ids(s)
        B, T, V = s.logits.shape
        M = jnp.asarray(self.max_post_edit_steps, jnp.int32)
        logits = s.writable(s.logits)
        vocab = jnp.arange(V)
        lse = jax.nn.logsumexp(s.logits, axis=-1)

        def best(excluded):  # argmax with the ids `excluded` ([B, T, V] bool) left out, and its probability
            x = jnp.argmax(jnp.where(excluded, -jnp.inf, logits), axis=-1).astype(jnp.int32)
            return x, jnp.exp(jnp.take_along_axis(s.logits, x[..., None], axis=-1)[..., 0] - lse)

        is_mask_id = vocab == s.mask_id
        specials = is_mask_id | (vocab == delete[:, None, None]) | (vocab == split[:, None, None])  # [B, 1, V]

        def special(ids):
            return (ids == s.mask_id) | (ids == delete[:, None]) | (ids == split[:, None])

        x, p = best(jnp.zeros((1, 1, V), bool))
        tokens, prompt = s.tokens, s.prompt
        masks = s.candidates & ~prompt
        original = jnp.where((st.updates == 0)[:, None], masks, st.original)  # flags set at the block's first pass
        orig_masks = original & masks
        n_orig, n_total = jnp.sum(orig_masks, axis=1), jnp.sum(masks, axis=1)
        updates = st.updates + 1
        post = st.post + (n_orig == 0)
        cleanup = (M > 0) & (post >= M) | (M == 0) & (n_orig == 0) | (updates > T + M)

        fallback = ~cleanup[:, None] & orig_masks & (x == s.mask_id)
        x_no_mask, p_no_mask = best(is_mask_id[None, None])
        x, p = jnp.where(fallback, x_no_mask, x), jnp.where(fallback, p_no_mask, p)

        quota = 1 + n_total - n_orig
        high = masks & (p > per_row(self.threshold))
        enough = jnp.sum(high, axis=1) >= quota
        top = masks & (rank_by(p, masks) < jnp.minimum(quota, n_total)[:, None])
        left = (n_orig > 0)[:, None]
        commit = first_clause(left & enough[:, None] & high, left & ~enough[:, None] & top,
                              ~left & masks, jnp.zeros_like(masks))
        last_originals = (M == 0) & (n_orig > 0) & ~jnp.any(orig_masks & (commit == 0), axis=1)
        cleanup |= last_originals
        commit = jnp.where(cleanup[:, None], jnp.where(masks, jnp.int8(4), jnp.int8(0)), commit)

        edit = (p > per_row(self.edit_threshold)) & (tokens != x) & ~masks & ~prompt & s.valid
        transfer = (commit > 0) | edit
        nothing = ~jnp.any(transfer, axis=1)

        x_plain, _ = best(specials)  # the cleanup writes no mask, DELETE or SPLIT
        x = jnp.where(cleanup[:, None] & transfer & special(x), x_plain, x)

        # anti-loop: this block's content at the start of an earlier pass
        H = st.seen.shape[1]
        earlier = jnp.arange(H)[None, :] < st.updates[:, None]
        seen_before = jnp.any(earlier & jnp.all(st.seen == tokens[:, None, :], axis=2), axis=1)
        changing = transfer & (x != tokens)
        at = jnp.argmin(jnp.where(changing, p, jnp.inf), axis=1)
        onehot = jnp.arange(T)[None, :] == at[:, None]
        history = jnp.take_along_axis(st.written, at[:, None, None], axis=1)[:, 0]  # [B, H], V: none
        used = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], history].set(True, mode="drop")
        used |= jnp.take_along_axis(orig_masks, at[:, None], axis=1) & is_mask_id[None, :]
        fresh = jnp.argmax(jnp.where(used, -jnp.inf, jnp.take_along_axis(logits, at[:, None, None], axis=1)[:, 0]),
                           axis=-1).astype(jnp.int32)
        loops = seen_before & ~cleanup & jnp.any(changing, axis=1)
        x = jnp.where(loops[:, None] & onehot, fresh[:, None], x)

        pass_index = (jnp.arange(H) == st.updates[:, None])  # [B, H]: this pass's slot
        seen = jnp.where(pass_index[:, :, None], tokens[:, None, :], st.seen)
        written = jnp.where(pass_index[:, None, :] & transfer[:, :, None], x[:, :, None], st.written)

        wrote = jnp.where(transfer, x, tokens)
        insert = transfer & (x == split[:, None])
        drop = transfer & (x == delete[:, None])
        edited = transfer & ~masks & (x != tokens) & ~special(x)
        block, flags = rebuild(wrote, tokens, original, prompt, mask_id=s.mask_id, delete=delete, split=split)
        finished = nothing | cleanup
        block = jnp.where(nothing[:, None], tokens, block)
        flags = jnp.where(nothing[:, None], original, flags)
        commit = jnp.where(nothing[:, None], jnp.int8(0), commit)
        return (Decision(commit, edit=edited, finished=finished, block=block, insert=insert, delete=drop),
                IndelState(flags, post, updates, seen, written))
