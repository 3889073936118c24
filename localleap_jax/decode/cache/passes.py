"""The pieces a cache policy's pass is made of: whole-canvas passes for some rows only (lanes), a pass over a subset
of each row's positions (gathered, of static capacity), and the layer loop over the model's pure pieces that the
field's caches run (with the attention probabilities, when a policy declares it needs them).

Per-row refreshes without paying for the batch: a pass where some rows refresh (run the whole canvas) and the others
take their cached pass runs the whole canvas only for the refreshing rows, gathered into `lanes` (1, 2, 4, ... B of
them: the fewest that hold them, `lane_sizes`, a `lax.switch` over those sizes), and the cached pass for the others. No row waits
for a lane, so a row's passes are those it takes alone, and the batch pays one full pass per refreshing row, not per
row of the batch.

Shapes are static, so a pass over a subset of positions runs at one of a few capacities (`capacities`: from the block
length up to the canvas, at most `MAX_WIDTHS` of them), the smallest that holds every row's subset; the unused slots
are neither queries that matter nor keys anyone sees.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.decode.canvas import Canvas, rows_take
from localleap_jax.errors import DecodeError
from localleap_jax.model import (KVCache, attention_inputs, attention_output, attention_two_parts, feed_forward,
                                 heads_first, layer_kinds)

MAX_WIDTHS = 5  # capacities of a subset pass (each a compiled copy of the trunk)


def lane_sizes(batch: int) -> tuple[int, ...]:
    """The lane counts a refreshing pass can take: 1, 2, 4, ... up to the batch (the batch itself last). Each size is
    a compiled copy of the whole-canvas pass: fewer sizes compile faster (a quarter of the batch or all of it: 60% of
    the compile time at B=8) but lose what slots gain under a cache (measured with bench_slots: threshold under
    dual 0.80x the fixed batches' tokens/s with those two sizes)."""
    sizes, r = [], 1
    while r < batch:
        sizes.append(r)
        r *= 2
    return tuple(sizes) + (batch,)


def capacities(length: int, smallest: int) -> tuple[int, ...]:
    """Widths of a subset pass: geometric from `smallest` to `length` (included), at most MAX_WIDTHS."""
    smallest = max(1, min(smallest, length))
    if smallest == length:
        return (length,)
    ratio = max(2.0, (length / smallest) ** (1.0 / (MAX_WIDTHS - 1)))
    sizes, w = [], float(smallest)
    while int(w) < length:
        if not sizes or int(w) > sizes[-1]:
            sizes.append(int(w))
        w *= ratio
    return tuple(sizes) + (length,)


def pick_width(count: Int[Array, ""], widths: tuple[int, ...]) -> Int[Array, ""]:
    """The index of the smallest width >= count."""
    return jnp.minimum(jnp.searchsorted(jnp.asarray(widths), count, side="left"), len(widths) - 1)


def in_lanes(rows: Bool[Array, "B"], run: Callable, into, gather: bool = True):
    """`run(idx [R], valid [R]) -> (outs, writes)` for the `rows` gathered into R lanes (R from `lane_sizes`, the
    fewest that hold them; none when no row is marked): `outs` (leaves [R, ...]) come back scattered into zeros of
    [B, ...] (the rows not marked hold zeros), `writes` (leaves [R, ...], the structure of `into`, leaves [B, ...])
    scattered into `into` at the lane rows. `gather` False (a denoiser whose rows are tied to their place in the
    batch, `Denoiser.lanes`): one lane per row of the batch, in place, when any row is marked."""
    B = rows.shape[0]
    n = jnp.sum(rows, dtype=jnp.int32)
    order = jnp.argsort(~rows, stable=True)  # the marked rows first, in row order
    sizes = lane_sizes(B) if gather else (B,)

    def lanes(R: int):
        def go(into):
            # every row: in place (no gather); fewer: the marked rows first
            idx, valid = (jnp.arange(B), rows) if R == B else (order[:R], jnp.arange(R) < n)
            outs, writes = run(idx, valid)
            dest = jnp.where(valid, idx, B)  # lanes beyond the marked rows write nothing
            outs = jax.tree.map(lambda o: jnp.zeros((B,) + o.shape[1:], o.dtype).at[dest].set(o, mode="drop"), outs)
            into = jax.tree.map(lambda a, w: a.at[dest].set(w.astype(a.dtype), mode="drop"), into, writes)
            return outs, into
        return go

    shapes = jax.eval_shape(lanes(sizes[0]), into)[0]

    def none(into):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), into

    branch = jnp.where(n == 0, 0, 1 + jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), n, side="left"), len(sizes) - 1))
    return jax.lax.switch(branch, [none] + [lanes(R) for R in sizes], into)


def canvas_rows(canvas: Canvas, idx: Int[Array, "R"]) -> Canvas:
    """The layout of rows idx of a batch (a lane's)."""
    return dataclasses.replace(canvas, x0=canvas.x0[idx], positions=canvas.positions[idx],
                               key_mask=canvas.key_mask[idx], first_start=canvas.first_start[idx],
                               row_blocks=canvas.row_blocks[idx])


def needs_layers(denoiser, name: str):
    """The model's decoding parameters and config, which a policy that runs its own layer loop needs (not a stub)."""
    if not hasattr(denoiser, "params") or not hasattr(denoiser, "config"):
        raise DecodeError(f"cache {name} runs the model's layers itself: it needs a model's denoiser "
                          f"(ll.load), not {type(denoiser).__name__}")
    return denoiser.params, denoiser.config


def attention_with_probs(q: Float[Array, "B T N H"], parts) -> tuple[Float[Array, "B T N H"], list]:
    """`model.attention_two_parts` (the same arithmetic), also returning each part's probabilities averaged over the
    heads: [B, T, S] per part. (Named in the program, `attention-weights`: a policy that does not declare
    `attention_weights` has none.)"""
    with jax.named_scope("attention-weights"):
        return _attention_with_probs(q, parts)


def _attention_with_probs(q, parts):
    B, T, N, H = q.shape
    K = parts[0][0].shape[1]  # parts heads first, as model.attention_two_parts takes them
    qg = q.reshape(B, T, K, N // K, H)
    scale = jnp.float32(1.0 / np.sqrt(H))
    big_negative = jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max))
    logits = []
    for k, _, mask in parts:
        s = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        logits.append(jnp.where(mask[:, None, None, :, :], s, big_negative))
    probs32 = jax.nn.softmax(jnp.concatenate(logits, axis=-1), axis=-1)
    probs = probs32.astype(parts[0][1].dtype)
    out, at, averaged = None, 0, []
    for k, v, _ in parts:
        width = k.shape[2]
        o = jnp.einsum("bkgts,bksh->btkgh", probs[..., at:at + width], v)
        out = o if out is None else out + o
        averaged.append(jnp.mean(probs32[..., at:at + width], axis=(1, 2)))
        at += width
    return out.reshape(B, T, N, H), averaged


def embed(params, tokens: Int[Array, "B Q"]) -> Float[Array, "B Q D"]:
    return jnp.take(params["wte"]["embedding"], tokens, axis=0)


def subset_pass(denoiser, canvas: Canvas, x: Int[Array, "B L"], idx: Int[Array, "B C"], fresh: Bool[Array, "B C"],
                kv: KVCache | None, *, store: bool, probs: bool = False, name: str = "cache"):
    """Each row's positions idx (canvas indices) through every layer, attending over every key of the canvas: the
    fresh ones (`fresh`) with this pass's K/V, every other position's from `kv` (None: the subset is the whole canvas,
    nothing is read). -> (hidden [B, C, D] (those of slots not fresh mean nothing), kv with the fresh K/V written
    when `store`, per-layer head-averaged attention probabilities [B, C, L] over canvas key positions or None)."""
    params, c = needs_layers(denoiser, name)
    B, C = idx.shape
    L = canvas.length
    rows = jnp.arange(B)[:, None]
    positions = rows_take(canvas.positions, idx)
    real = rows_take(canvas.key_mask, idx)
    own = (fresh & real)[:, None, :]  # [B, 1, C]: the subset's own keys, fresh and real
    if kv is not None:
        replaced = jnp.zeros((B, L), bool).at[rows, idx].max(fresh)
        seen = (canvas.key_mask & ~replaced)[:, None, :]
    dest = jnp.where(fresh, idx, L)  # where a fresh K/V goes (slots not fresh: nowhere)
    h = embed(params, rows_take(x, idx))
    ks, vs, maps = [], [], []
    for i, (p, moe) in enumerate(zip(params["layers"], layer_kinds(c))):
        q, k, v = attention_inputs(p, h, positions, c)
        k, v = heads_first(k), heads_first(v)
        parts = ((k, v, own),) if kv is None else ((kv.k[i], kv.v[i], seen), (k, v, own))
        if probs:
            o, averaged = attention_with_probs(q, parts)
            own_probs = averaged[-1]  # [B, C, C]: onto the subset's own keys, put at their canvas positions
            onto = (jnp.zeros((B, C, L), jnp.float32) if kv is None else averaged[0])
            maps.append(onto.at[rows[:, :, None], jnp.arange(C)[None, :, None], idx[:, None, :]].add(own_probs))
        else:
            o = attention_two_parts(q, parts)
        h = h + attention_output(p, o)
        h = h + feed_forward(p, h, c, moe)
        if store:
            if kv is None:
                ks.append(k)
                vs.append(v)
            else:
                at = (rows[:, None, :], jnp.arange(c.n_kv_heads)[None, :, None], dest[:, None, :])  # [B, K, C]
                ks.append(kv.k[i].at[at].set(k.astype(kv.k[i].dtype), mode="drop"))
                vs.append(kv.v[i].at[at].set(v.astype(kv.v[i].dtype), mode="drop"))
    new = (KVCache(tuple(ks), tuple(vs)) if store else kv)
    return h, new, (maps if probs else None)


def subset_of(marked: Bool[Array, "B L"], width: int) -> tuple[Int[Array, "B W"], Bool[Array, "B W"]]:
    """Each row's marked positions in canvas order, in `width` slots: (idx, fresh); the slots past a row's count
    hold unmarked positions, not fresh."""
    order = jnp.argsort(~marked, axis=1, stable=True)[:, :width]
    return order, jnp.take_along_axis(marked, order, axis=1)


def slot_of(marked: Bool[Array, "B L"], idx: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Where position idx of each row sits in `subset_of(marked, ...)` (meaningless where it is not marked)."""
    rank = jnp.cumsum(marked.astype(jnp.int32), axis=1) - 1
    return jnp.maximum(rows_take(rank, idx), 0)


def subset_hidden(denoiser, canvas: Canvas, x, marked: Bool[Array, "B L"], at: Int[Array, "B T"], kv, *,
                  store: bool, name: str, widths: tuple[int, ...] | None = None):
    """The positions `marked` of each row through the layers over `kv` (a subset pass at the smallest capacity that
    holds every row's): (hidden states at positions `at` [B, T, D] (zeros where `at` is not marked), kv (with the
    marked positions' K/V when `store`))."""
    widths = widths or capacities(canvas.length, canvas.block_length)
    count = jnp.max(jnp.sum(marked, axis=1))

    def width(W: int):
        def go(kv):
            idx, fresh = subset_of(marked, W)
            h, kv2, _ = subset_pass(denoiser, canvas, x, idx, fresh, kv, store=store, name=name)
            got = rows_take(h, slot_of(marked, at))
            return jnp.where(rows_take(marked, at)[..., None], got, jnp.zeros((), h.dtype)), kv2
        return go

    return jax.lax.switch(pick_width(count, widths), [width(W) for W in widths], kv)
