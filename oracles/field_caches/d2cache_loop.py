"""d2Cache (Kamichanw/d2Cache @ 72feb60, `src/cache/d2cache.py` `d2Cache.model_forward`, `.attention`,
`.accumulate_attn_rollout`, `.on_step_end`; `src/utils/common.py` `certainty_density`, `nucleus_select`;
`src/generation/vanilla.py` `vanilla_generate`, `generate_step`, `confidence_unmasking`;
`src/generation/utils.py` `sample_tokens`), one row, eagerly. See the package doc."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from oracles.field_caches.common import (BlockRule, CacheResult, CommitRule, Log, canvas, has_mask, predict,
                                         stuck)


def certainty_density(decoded: torch.Tensor, sigma: float) -> torch.Tensor:
    """The Gaussian-kernel (std sigma) average of the decoded indicator decoded [G] (bool) -> [G], in fp32 by FFT
    as the authors compute it.

    The indicator is extended to [G left | G | G right]: the left third counts decoded, the right third counts
    decoded only if the region's last position is decoded. A circular convolution of length 6G with the kernel
    exp(-d^2 / 2 sigma^2) at offsets d = 0..3G-1, -3G..-1 gives, at region position i,
        sum_{j in [-G, 2G)} indicator(j) exp(-(i - j)^2 / 2 sigma^2),
    and it is divided by the kernel's sum over ALL 6G offsets (the convolution of an all-ones signal of length 6G:
    the same constant at every position, not the mass inside the 3G window)."""
    assert sigma > 0
    G = decoded.shape[0]
    right = 1.0 if bool(decoded[-1]) else 0.0
    extended = torch.cat([torch.ones(G), decoded.float(), torch.full((G,), right)])  # [3G]
    n = 6 * G
    offsets = torch.cat([torch.arange(3 * G), torch.arange(-3 * G, 0)])
    kernel = torch.fft.fft(torch.exp(-(offsets ** 2) / (2 * sigma ** 2)), n=n)
    weighted = torch.fft.ifft(torch.fft.fft(torch.cat([extended, torch.zeros(3 * G)]), n=n) * kernel, n=n).real
    total = torch.fft.ifft(torch.fft.fft(torch.ones(n), n=n) * kernel, n=n).real
    return weighted[G:2 * G] / total[G:2 * G].clamp_min(1e-8)


def rollout_step(rollout: torch.Tensor, probs: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """One layer of the attention rollout: rows of the queries = the head-averaged probabilities probs [H, n, L],
    every other row the identity's; plus the identity, rows normalised to 1; -> that matrix @ rollout [L, L]."""
    L = rollout.shape[0]
    eye = torch.eye(L, dtype=probs.dtype)
    attn = eye.clone()
    attn[queries] = probs.mean(dim=0)
    residual = attn + eye
    return (residual / residual.sum(dim=-1, keepdim=True)) @ rollout


def nucleus(importance: torch.Tensor, top_p: float, allowed: torch.Tensor) -> torch.Tensor:
    """nucleus_select (min_k 1): among the allowed positions (the others' importance counts 0), sorted by
    importance / (their total + 1e-9), those whose cumulative share is <= top_p, and always the first. -> [L] bool"""
    scores = torch.where(allowed, importance, torch.zeros_like(importance))
    share = scores / (scores.sum() + 1e-9)
    ordered, order = torch.sort(share, descending=True)
    keep = (ordered.cumsum(0) <= top_p) | (torch.arange(share.shape[0]) < 1)
    keep &= allowed[order]
    return torch.zeros_like(allowed).scatter(0, order, keep)


def inflate(picked: torch.Tensor, width: int) -> torch.Tensor:
    """Pick every unpicked position whose distance to the previous picked position plus the distance to the next
    one is <= width (a position before the first or after the last pick stays unpicked). picked [L] bool."""
    L = picked.shape[0]
    idx = torch.arange(L)
    nxt = torch.flip(torch.cummin(torch.flip(torch.where(picked, idx, L), [0]), 0).values, [0])
    prv = torch.cummax(torch.where(picked, idx, -1), 0).values
    return picked | (((nxt - idx) + (idx - prv) <= width) & (prv >= 0) & (nxt < L))


class Picks(NamedTuple):
    """The next pass's queries and why (canvas positions, each a sorted tuple; the first reason wins)."""

    current: tuple[int, ...]  # 1. up to current_k masks by cached confidence x certainty density
    committed: tuple[int, ...]  # 2. this pass's commits not already in 1
    rollout: tuple[int, ...]  # 3. the attention-rollout nucleus
    inflated: tuple[int, ...]  # 4. gaps of at most inflate_w between picks
    queries: torch.Tensor  # [L] bool: all of them


def pick_queries(*, P: int, block_masked: torch.Tensor, remaining: torch.Tensor, conf_cache: torch.Tensor,
                 commits: Sequence[int], rollout: torch.Tensor, rollout_p: float, current_k: int, sigma: float,
                 inflate_w: int) -> Picks:
    """d2Cache.on_step_end for one row: the next pass's query positions.

    block_masked [G]: the positions of the block this pass decoded that were masks at its INPUT (what their
    `block_mask` has become by then: check_can_generate narrows it in place every pass); remaining [G]: masks after
    this pass; conf_cache [G]: the first pass's confidences; commits: canvas positions this pass committed; rollout
    [L, L]: this pass's attention rollout."""
    G = remaining.shape[0]
    L = P + G
    # 1. the search range: from the block's first masked position to the end of the "block" in which the
    #    current_k-th remaining mask lies (counted from the region's start), else the region's end, on a grid
    #    whose unit is the number of the block's masks at the pass's input (their block_size), not block_length
    unit = int(block_masked.sum())
    count = remaining.int().cumsum(0)
    reached = count >= current_k
    first_end = int(torch.argmax(reached.int())) if bool(reached.any()) else G - 1
    search_end = (first_end // unit + 1) * unit - 1
    col = torch.arange(G)
    search = (col >= int(torch.argmax(block_masked.int()))) & (col <= search_end)
    scores = conf_cache * certainty_density(~remaining, sigma)
    scores = torch.where(block_masked, scores + scores.max(), scores)  # the block's masks rank first
    top = torch.topk(torch.where(search & remaining, scores, -float("inf")), k=min(current_k, G)).indices
    current = torch.zeros(G, dtype=torch.bool)
    current[top] = True
    current &= remaining
    # 2. this pass's commits: a committed token is recomputed with its own embedding in the next pass
    response = current.clone()
    response[[c - P for c in commits]] = True
    queries = torch.cat([torch.zeros(P, dtype=torch.bool), response])
    after_2 = queries.clone()
    # 3. the rollout nucleus among the positions not yet picked (the prompt's included)
    importance = rollout.sum(dim=0)  # column sums
    queries |= nucleus(importance, rollout_p, ~queries)
    after_3 = queries.clone()
    # 4. inflation
    if inflate_w > 0:
        queries = inflate(queries, inflate_w)
    as_tuple = lambda m: tuple(int(j) for j in torch.nonzero(m).flatten())  # noqa: E731
    cur = torch.cat([torch.zeros(P, dtype=torch.bool), current])
    return Picks(as_tuple(cur), as_tuple(after_2 & ~cur), as_tuple(after_3 & ~after_2), as_tuple(queries & ~after_3),
                 queries)


@torch.no_grad()
def d2cache(net, prompt: torch.Tensor, *, gen_length: int, block_length: int, mask_id: int, rule: CommitRule,
            rollout_p: float = 0.1, current_k: int = 32, sigma: float = 10.0, inflate_w: int = 4,
            exclude_ids: Sequence[int] = ()) -> CacheResult:
    """d2Cache under d2Cache's vanilla loop on one row (prompt [P], unpadded) -> CacheResult.

    The first pass runs every position and keeps every layer's keys/values; each later pass runs only the
    positions picked after the previous pass (`pick_queries`), writes their fresh keys/values into the cache and
    attends over the whole cache; the others get all-zero logits (a uniform 1 / vocab confidence; they stay
    candidates). There is no refresh. The loop runs passes until the block has no mask; the rule's step is the
    block's pass index.

    Log: kind "full" (the first pass) or "partial"; queries: the positions run; detail: "next" (the Picks made
    after the pass, its tensor left out: current, committed, rollout, inflated).
    """
    if not 0 <= rollout_p <= 1 or current_k < 1 or sigma <= 0 or inflate_w < 0:
        raise ValueError("0 <= rollout_p <= 1, current_k >= 1, sigma > 0, inflate_w >= 0")
    x, P, num_blocks = canvas(prompt, gen_length, block_length, mask_id)
    L = x.shape[0]
    kv, queries, conf_cache, log = None, None, None, Log()
    for b in range(num_blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        block = BlockRule(rule, int((x[lo:hi] == mask_id).sum()), num_blocks, exclude_ids, mask_id)
        step = 0
        while has_mask(x, lo, hi, mask_id):
            stuck(step, block_length)
            q_idx = torch.arange(L) if queries is None else torch.nonzero(queries).flatten()
            out = net.run(x, q_idx, kv, with_probs=True)
            if kv is None:
                kv = [(k.clone(), v.clone()) for k, v in zip(out.keys, out.values)]
            else:
                for layer, (k, v) in enumerate(kv):  # the queries' fresh keys/values are written back
                    k[q_idx], v[q_idx] = out.keys[layer], out.values[layer]
            logits = torch.zeros((L, out.logits.shape[-1]), dtype=out.logits.dtype)
            logits[q_idx] = out.logits
            rollout = torch.eye(L, dtype=out.probs[0].dtype)
            for p in out.probs:
                rollout = rollout_step(rollout, p, q_idx)
            if conf_cache is None:  # the first pass's confidence (fp32 softmax), never updated afterwards
                conf_cache = predict(logits[P:], exclude_ids, torch.float32)[1]
                conf_cache = torch.where(x[P:] == mask_id, conf_cache, -float("inf"))
            block_masked = torch.zeros(L, dtype=torch.bool)
            block_masked[lo:hi] = x[lo:hi] == mask_id
            commits = block.commit(x, lo, hi, logits[lo:hi], step)
            picks = pick_queries(P=P, block_masked=block_masked[P:], remaining=x[P:] == mask_id,
                                 conf_cache=conf_cache, commits=commits, rollout=rollout, rollout_p=rollout_p,
                                 current_k=current_k, sigma=sigma, inflate_w=inflate_w)
            log.add("full" if queries is None else "partial", b, step, q_idx, commits, True,
                    next=picks._asdict() | {"queries": None})
            queries = picks.queries
            step += 1
    return log.result(x)
