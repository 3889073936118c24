"""d2Cache (`d2cache`: Kamichanw/d2Cache @ 72feb60, `src/cache/d2cache.py`, `src/utils/common.py`): each pass runs
only the positions picked after the previous one, over every other position's K/V as last computed.

Per row:
  - The row's first pass runs the whole canvas and stores every layer's K/V; there is no refresh afterwards: a
    position's K/V change only in a pass that runs it (they are written back), and a block change triggers nothing.
  - After each pass the next pass's queries are picked (`pick_queries`):
    1. up to current_k of the region's remaining masks, ranked by score = the first pass's confidence (never updated:
       the authors' update writes into a copy) x the certainty density (a Gaussian kernel, std sigma, average of the
       decoded indicator over the generated region, left of it counted decoded, right of it decoded only if its last
       position is); the pass's block's masks first (their score + the largest score); among region positions from
       the block's first mask at the pass's input to the end of the grid cell holding the current_k-th remaining
       mask, on a grid whose unit is the number of the block's masks at the pass's input (the authors narrow their
       block mask in place every pass: that count, not block_length, is their `block_size` there);
    2. every position the pass committed (a token is recomputed, with its own embedding, in the pass after it);
    3. among the positions not picked yet, a nucleus over the attention rollout (per layer the head-averaged
       probabilities of the pass's queries, identity rows elsewhere, plus the identity, rows normalised, multiplied
       from the first layer; importance = column sums): positions by importance share, kept while the cumulative
       share is <= rollout_p, and always the top one;
    4. inflation: an unpicked position whose distances to the previous and the next pick sum to <= inflate_w.
    With a logits shift (Dream) a pick of position j is a query at j - 1 (its hidden state predicts j), as the
    authors' Dream path does.
  - Only the picked positions have hidden states; the others get all-zero logits (confidence 1 / vocab) and stay
    candidates (the authors' loop means to drop them, on a copy). A rule that reads the block's decoded positions
    (one that remasks or edits) is refused.

Each row picks its own queries (the authors top every row of a batch up to the batch's largest count, so a row's
tokens depend on its batch); a pass runs at the smallest of a few static capacities that holds every row's picks
(passes.capacities), first passes in lanes. The attention probabilities are computed by this policy's own layer loop
(passes.subset_pass with probs): no other program has them. Every setting is traced per row. The authors' certainty
prior commit rule is not part of the cache (off, as they advise with threshold decoding).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.decode.cache.fast_dllm import when_else, where_rows
from localleap_jax.decode.cache.passes import canvas_rows, capacities, in_lanes, pick_width, slot_of, subset_of, subset_pass
from localleap_jax.decode.cache.protocol import Hidden, PolicyBase, from_full, per_row, setting
from localleap_jax.decode.canvas import Block, rows_take
from localleap_jax.rules.base import rank_by


class D2State(NamedTuple):
    kv: object
    picks: Bool[Array, "B L"]  # the next pass's queries
    started: Bool[Array, "B"]  # the row had its first pass (its picks are set)
    conf: Float[Array, "B G"]  # the first pass's confidence over the region (-inf at what was decoded then)
    importance: Float[Array, "B L"]  # the last pass's rollout column sums


def rollout_importance(maps: list, idx: Int[Array, "B C"], fresh: Bool[Array, "B C"], real: Bool[Array, "B L"]
                       ) -> Float[Array, "B L"]:
    """Column sums of the attention rollout (the product, from the first layer, of each layer's rows-normalised
    head-averaged probabilities of its queries plus the identity, identity rows elsewhere), as a vector times the
    layers from the last: 1^T A_N ... A_1. `maps`: per layer [B, C, L] (query slot, key position). Padding (`real`
    False) is neither counted nor reached, as if the row were alone."""
    B, C = idx.shape
    rows = jnp.arange(B)[:, None]
    v = real.astype(jnp.float32)
    for p in reversed(maps):
        s = jnp.sum(p, axis=-1) + 1.0  # the row sums of probabilities + identity
        vq = jnp.where(fresh, rows_take(v[..., None], idx)[..., 0], 0.0)
        w = vq / s
        v = v.at[rows, idx].add(-vq) + jnp.einsum("bc,bcl->bl", w, p) + jnp.zeros_like(v).at[rows, idx].add(w)
    return v


def certainty_density(decoded: Bool[Array, "B G"], sigma: Float[Array, "B"]) -> Float[Array, "B G"]:
    """The Gaussian-kernel (std sigma) average of the decoded indicator over the region, left of it counted decoded,
    right of it decoded iff its last position is: sum over j in [-G, 2G) of indicator(j) k(i - j), over the kernel's
    sum at every offset in [-3G, 3G) (the authors' FFT of length 6G; summed here directly)."""
    B, G = decoded.shape
    right = decoded[:, -1:].astype(jnp.float32)
    extended = jnp.concatenate([jnp.ones((B, G)), decoded.astype(jnp.float32), jnp.broadcast_to(right, (B, G))],
                               axis=1)  # positions -G .. 2G-1
    two_s2 = 2.0 * jnp.asarray(sigma, jnp.float32)[:, None, None] ** 2
    d = (jnp.arange(G)[:, None] - jnp.arange(-G, 2 * G)[None, :]).astype(jnp.float32)
    weighted = jnp.einsum("bij,bj->bi", jnp.exp(-(d[None] ** 2) / two_s2), extended)
    offsets = jnp.arange(-3 * G, 3 * G).astype(jnp.float32)
    total = jnp.sum(jnp.exp(-(offsets[None, :] ** 2) / two_s2[:, :, 0]), axis=1, keepdims=True)
    return weighted / jnp.maximum(total, 1e-8)


def nucleus(importance: Float[Array, "B L"], top_p: Float[Array, "B"], allowed: Bool[Array, "B L"]
            ) -> Bool[Array, "B L"]:
    """Among the allowed positions, by importance share (of their total), those whose cumulative share is <= top_p,
    and always the first."""
    scores = jnp.where(allowed, importance, 0.0)
    share = scores / (jnp.sum(scores, axis=1, keepdims=True) + 1e-9)
    order = jnp.argsort(-share, axis=1, stable=True)
    ordered = jnp.take_along_axis(share, order, axis=1)
    keep = (jnp.cumsum(ordered, axis=1) <= per_row(top_p, ordered)) | (jnp.arange(share.shape[1]) < 1)
    keep &= jnp.take_along_axis(allowed, order, axis=1)
    B = share.shape[0]
    return jnp.zeros_like(allowed).at[jnp.arange(B)[:, None], order].set(keep)


def inflate(picked: Bool[Array, "B L"], width: Int[Array, "B"]) -> Bool[Array, "B L"]:
    """Every unpicked position whose distance to the previous pick plus the distance to the next is <= width (none
    before the first pick or after the last); width 0: nothing."""
    L = picked.shape[1]
    pos = jnp.arange(L)
    nxt = jax.lax.cummin(jnp.where(picked, pos, L), axis=1, reverse=True)
    prv = jax.lax.cummax(jnp.where(picked, pos, -1), axis=1)
    w = per_row(width, picked)
    return picked | (((nxt - pos) + (pos - prv) <= w) & (prv >= 0) & (nxt < L) & (w > 0))


@struct.dataclass
class D2Cache(PolicyBase):
    rollout_p: float = setting(0.1, low=0.0, high=1.0)
    current_k: int = setting(32, int, low=1)
    sigma: float = setting(10.0, low=0.0, low_open=True)
    inflate_w: int = setting(4, int, low=0)

    name: ClassVar[str] = "d2cache"
    computes: ClassVar[str] = "positions (picked after the previous pass)"
    keeps: ClassVar[str] = "kv (each position's as last computed), the first pass's confidences"
    refreshes: ClassVar[str] = "never"
    attention_weights: ClassVar[bool] = True
    whole_block: ClassVar[bool] = False

    def init(self, denoiser, canvas):
        B, L, G = canvas.batch, canvas.length, canvas.gen_length
        return D2State(denoiser.empty_cache(B, L), jnp.zeros((B, L), bool), jnp.zeros((B,), bool),
                       jnp.zeros((B, G), jnp.float32), jnp.zeros((B, L), jnp.float32))

    def refill(self, denoiser, canvas, state, rows):
        return state._replace(started=state.started & ~rows)

    def forward(self, denoiser, canvas, x, block, state, view):
        B, L, P, shift = canvas.batch, canvas.length, canvas.prompt_length, canvas.shift
        first = ~view.done & ~state.started

        def whole(idx, valid):  # a row's first pass: every position, its K/V stored, with the rollout
            everything = jnp.broadcast_to(jnp.arange(L), (idx.shape[0], L))
            lane = canvas_rows(canvas, idx)
            h, kv, maps = subset_pass(denoiser, lane, x[idx], everything, jnp.ones((idx.shape[0], L), bool), None,
                                      store=True, probs=True, name=self.name)
            importance = rollout_importance(maps, everything, lane.key_mask, lane.key_mask)
            h_block, h_region = from_full(h, lane, Block(block.starts[idx], block.idx[idx], block.tokens[idx]), True)
            _, conf = view.score(h_region)
            conf = jnp.where(x[idx][:, P:] == canvas.mask_id, conf, -jnp.inf)
            return (h_block, importance, conf), kv

        (h_first, imp_first, conf_first), kv = in_lanes(first, whole, state.kv, gather=getattr(denoiser, "lanes", True))
        later = ~view.done & state.started
        marked = state.picks & later[:, None]
        widths = capacities(L, canvas.block_length)

        def picked(kv):
            def at_width(W: int):
                def go(kv):
                    idx, fresh = subset_of(marked, W)
                    h, kv, maps = subset_pass(denoiser, canvas, x, idx, fresh, kv, store=True, probs=True,
                                              name=self.name)
                    at = block.idx - shift
                    got = rows_take(h, slot_of(marked, at))
                    h_block = jnp.where(rows_take(marked, at)[..., None], got, jnp.zeros((), h.dtype))
                    return (h_block, rollout_importance(maps, idx, fresh, canvas.key_mask)), kv
                return go
            count = jnp.max(jnp.sum(marked, axis=1))
            return jax.lax.switch(pick_width(count, widths), [at_width(W) for W in widths], kv)

        (h_later, imp_later), kv = when_else(jnp.any(later), picked, kv)
        state = state._replace(kv=kv, conf=where_rows(first, conf_first, state.conf),
                               importance=where_rows(first, imp_first, imp_later))
        return Hidden(where_rows(first, h_first, h_later), None, state, full=first)

    def update(self, denoiser, state, outcome):
        canvas = outcome.canvas
        working = outcome.step.working
        picks = self.pick_queries(canvas, state, outcome)
        return state._replace(picks=jnp.where(working[:, None], picks, state.picks),
                              started=state.started | working)

    def pick_queries(self, canvas, state: D2State, outcome) -> Bool[Array, "B L"]:
        """The next pass's queries (the module's docstring, 1 to 4)."""
        P, G, L, shift, m = canvas.prompt_length, canvas.gen_length, canvas.length, canvas.shift, canvas.mask_id
        B = outcome.before.shape[0]
        rows = jnp.arange(B)[:, None]
        remaining = outcome.after[:, P:] == m  # [B, G]
        in_block = (jnp.arange(P, L)[None, :] >= outcome.block.starts[:, None]) & (
            jnp.arange(P, L)[None, :] < (outcome.block.starts + canvas.block_length)[:, None])
        block_masked = in_block & (outcome.before[:, P:] == m)  # the block's masks at the pass's input
        unit = jnp.maximum(jnp.sum(block_masked, axis=1), 1)
        k = jnp.asarray(self.current_k, jnp.int32)
        reached = jnp.cumsum(remaining, axis=1) >= per_row(k, remaining)
        first_end = jnp.where(jnp.any(reached, axis=1), jnp.argmax(reached, axis=1), G - 1)
        search_end = (first_end // unit + 1) * unit - 1
        col = jnp.arange(G)[None, :]
        search = (col >= jnp.argmax(block_masked, axis=1)[:, None]) & (col <= search_end[:, None])
        scores = state.conf * certainty_density(~remaining, self.sigma)
        scores = jnp.where(block_masked, scores + jnp.max(scores, axis=1, keepdims=True), scores)
        eligible = search & remaining
        current = eligible & (rank_by(scores, eligible) < per_row(k, scores))
        committed = (outcome.before[:, P:] == m) & ~remaining
        region = current | committed  # 1 and 2, as region positions; queries run at position - shift
        queries = jnp.zeros((B, L), bool).at[rows, P - shift + jnp.arange(G)[None, :]].set(region)
        queries |= nucleus(state.importance, self.rollout_p, ~queries & canvas.key_mask)
        return inflate(queries, self.inflate_w)
