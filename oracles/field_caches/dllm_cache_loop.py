"""dLLM-Cache (maomaocun/dLLM-cache @ 17235bf, `dllm_cache/hooks/cache_hook_LLaDA.py` `cache_hook_feature` and
`refresh_index`, `dllm_cache/cache/Cache.py`, `utils/generate_function.py`), one row, eagerly. See the package doc."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from oracles.field_caches.common import BlockRule, CacheResult, CommitRule, Log, block_steps, canvas, has_mask


@dataclass
class Kept:
    """One layer's kept features, each split into the prompt part [P, .] and the response part [G, .]."""

    p_k: torch.Tensor | None = None
    p_v: torch.Tensor | None = None
    p_attn: torch.Tensor | None = None
    p_ffn: torch.Tensor | None = None
    r_k: torch.Tensor | None = None
    r_v: torch.Tensor | None = None
    r_attn: torch.Tensor | None = None
    r_ffn: torch.Tensor | None = None


def least_similar(fresh: torch.Tensor, kept: torch.Tensor, count: int) -> torch.Tensor:
    """refresh_index: the `count` rows whose fresh value vector has the lowest cosine similarity with the kept one
    (ties as torch.topk orders them). fresh, kept [G, Hkv*D] -> indices [count] into the response."""
    return torch.topk(F.cosine_similarity(fresh, kept, dim=-1), k=count, largest=False).indices


def cached_layer(net, i: int, h: torch.Tensor, kept: Kept, P: int, refresh_p: bool, refresh_r: bool, rho: float
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block under the hook: residual streams h [L, d] of every position -> (h after the block, the response
    indices picked by similarity or None)."""
    layer, L = net.layers[i], h.shape[0]
    G = L - P
    pos = torch.arange(L)
    hn = layer.attn_norm(h)
    picked = None
    if refresh_p and refresh_r:  # everything fresh, everything kept
        q, k, v = layer.q(hn), layer.k(hn), layer.v(hn)
        attn, _ = net.attend(i, q, pos, k, pos, v)
        kept.p_k, kept.r_k, kept.p_v, kept.r_v = k[:P], k[P:].clone(), v[:P], v[P:]
        kept.p_attn, kept.r_attn = attn[:P], attn[P:].clone()
    elif refresh_r:  # the response fresh; its queries attend over the kept prompt keys/values
        q, k, v = layer.q(hn[P:]), layer.k(hn[P:]), layer.v(hn[P:])
        kept.r_k, kept.r_v = k.clone(), v
        kept.r_attn, _ = net.attend(i, q, pos[P:], torch.cat([kept.p_k, k]), pos, torch.cat([kept.p_v, v]))
        kept.r_attn = kept.r_attn.clone()
        attn = torch.cat([kept.p_attn, kept.r_attn])
    else:
        queries, q_pos = [], []
        if refresh_p:
            kept.p_k, kept.p_v = layer.k(hn[:P]), layer.v(hn[:P])
            queries.append(layer.q(hn[:P]))
            q_pos.append(pos[:P])
        if rho > 0:  # every response value recomputed; the least similar ones get fresh queries, keys, outputs
            v_r = layer.v(hn[P:])
            picked = least_similar(v_r, kept.r_v, int(G * rho))
            kept.r_v = v_r
            kept.r_k[picked] = layer.k(hn[P + picked])
            queries.append(layer.q(hn[P + picked]))
            q_pos.append(P + picked)
        if queries:  # one attention call: the prompt's queries (if refreshed), then the picked response ones
            out, _ = net.attend(i, torch.cat(queries), torch.cat(q_pos), torch.cat([kept.p_k, kept.r_k]), pos,
                                torch.cat([kept.p_v, kept.r_v]))
            if refresh_p:
                kept.p_attn, out = out[:P], out[P:]
            if picked is not None:
                kept.r_attn[picked] = out
        attn = torch.cat([kept.p_attn, kept.r_attn])
    h = h + attn  # the residual stream itself is never kept
    if refresh_p and refresh_r:
        f = layer.ffn(h)
        kept.p_ffn, kept.r_ffn = f[:P], f[P:].clone()
    elif refresh_r:
        kept.r_ffn = layer.ffn(h[P:]).clone()
        f = torch.cat([kept.p_ffn, kept.r_ffn])
    else:
        rows = ([pos[:P]] if refresh_p else []) + ([P + picked] if picked is not None else [])
        if rows:
            out = layer.ffn(h[torch.cat(rows)])
            if refresh_p:
                kept.p_ffn, out = out[:P], out[P:]
            if picked is not None:
                kept.r_ffn[picked] = out
        f = torch.cat([kept.p_ffn, kept.r_ffn])
    return h + f, picked


@torch.no_grad()
def dllm_cache(net, prompt: torch.Tensor, *, gen_length: int, block_length: int, mask_id: int, rule: CommitRule,
               prompt_interval: int = 50, gen_interval: int = 7, transfer_ratio: float = 0.25,
               exclude_ids: Sequence[int] = ()) -> CacheResult:
    """dLLM-Cache on one row (prompt [P], unpadded) -> CacheResult.

    Pass n (1, 2, ... over the whole generation) refreshes the prompt part in layers >= 1 when
    (n - 1) % prompt_interval == 0 and the response part when (n - 1) % gen_interval == 0; layer 0 refreshes both
    on every pass. The loop is LLaDA's generate (steps_per_block passes per block) for a rule with a schedule,
    else Fast-dLLM's (passes until the block has no mask).

    Log: kind "full" (both parts refreshed), "prompt", "response" (that part only) or "cached" (neither);
    queries: the positions the schedule refreshed in layers >= 1; detail: "pass" (n), "refresh_prompt",
    "refresh_response", "picked" (per layer, a sorted tuple of the canvas positions picked by value similarity:
    empty in layer 0, in layers that refreshed the response, and with transfer_ratio 0).
    """
    if prompt_interval < 1 or gen_interval < 1 or not 0 <= transfer_ratio <= 1:
        raise ValueError("prompt_interval and gen_interval >= 1, 0 <= transfer_ratio <= 1")
    x, P, num_blocks = canvas(prompt, gen_length, block_length, mask_id)
    L = x.shape[0]
    # their `transfer = 0 < ratio <= 1`: a ratio whose int(G * ratio) is 0 still recomputes the values (and picks none)
    rho = transfer_ratio
    kept = [Kept() for _ in net.layers]
    log, n = Log(), 0
    for b in range(num_blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        block = BlockRule(rule, int((x[lo:hi] == mask_id).sum()), num_blocks, exclude_ids, mask_id)
        for i in block_steps(x, lo, hi, mask_id, None if block.quotas is None else len(block.quotas)):
            n += 1
            busy = has_mask(x, lo, hi, mask_id)
            refresh_p, refresh_r = (n - 1) % prompt_interval == 0, (n - 1) % gen_interval == 0
            h, picked = net.embed(x), []
            for layer in range(len(net.layers)):  # layer 0 refreshes everything on every pass
                h, p = cached_layer(net, layer, h, kept[layer], P, refresh_p or layer == 0, refresh_r or layer == 0,
                                    rho)
                picked.append(() if p is None else tuple(sorted(P + int(j) for j in p)))
            logits = net.head(h)
            kind = {(True, True): "full", (True, False): "prompt", (False, True): "response",
                    (False, False): "cached"}[(refresh_p, refresh_r)]
            queries = (list(range(P)) if refresh_p else []) + (list(range(P, L)) if refresh_r else [])
            log.add(kind, b, i, queries, block.commit(x, lo, hi, logits[lo:hi], i), busy, refresh_prompt=refresh_p,
                    refresh_response=refresh_r, picked=tuple(picked), **{"pass": n})
    return log.result(x)
