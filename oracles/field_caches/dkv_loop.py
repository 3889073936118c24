"""dKV-Cache-Decode for LLaDA (horseee/dKV-Cache @ 49a76fc, `generation_utils/llada_dkv_cache_decode.py` `generate`,
`models/modeling_llada_dkv_cache_decode.py` `LLaDALlamaBlock.forward`, `RotaryEmbedding`), one row, eagerly.
See the package doc."""

from __future__ import annotations

from typing import Sequence

import torch

from oracles.field_caches.common import BlockRule, CacheResult, CommitRule, Log, block_steps, canvas, has_mask


def pass_kind(i: int, reload_every: int) -> str:
    """The block's pass i: "full" (i = 0, nothing kept), "store" (i = 1: a full pass that keeps the keys/values of
    the positions decoded at its input), "reload" (i > 1, i % N == 0: the same) or "cached"."""
    if i == 0:
        return "full"
    if i == 1 or i % reload_every == 0:
        return "store" if i == 1 else "reload"
    return "cached"


@torch.no_grad()
def dkv(net, prompt: torch.Tensor, *, gen_length: int, block_length: int, mask_id: int, rule: CommitRule,
        reload_every: int = 8, exclude_ids: Sequence[int] = ()) -> CacheResult:
    """dKV-Cache-Decode on one row (prompt [P], unpadded) -> CacheResult.

    Per block, the cache starts empty. A cached pass runs, through every layer, the positions that were NOT
    decoded at the previous pass's input (every mask of the canvas plus what the previous pass committed) and reads
    every other key/value from the cache; afterwards the cache holds the positions decoded at this pass's input
    (the just-recomputed commits join it). The loop is LLaDA's generate (steps_per_block passes per block) for a
    rule with a schedule, else passes until the block has no mask (the check's patch of the loop header).

    Log: kind from `pass_kind`; queries: the recomputed positions (all in a full pass); detail: "cached" (the
    positions whose keys/values the pass read from the cache), "kept" (the positions held by the cache after it).
    """
    if reload_every < 1:
        raise ValueError("reload_every >= 1")
    x, P, num_blocks = canvas(prompt, gen_length, block_length, mask_id)
    L = x.shape[0]
    everything = torch.arange(L)
    log = Log()
    for b in range(num_blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        block = BlockRule(rule, int((x[lo:hi] == mask_id).sum()), num_blocks, exclude_ids, mask_id)
        kv, held = None, torch.zeros(L, dtype=torch.bool)  # the cache: [L] rows per layer, and which rows it holds
        decoded_before = None  # decoded at the previous pass's input
        for i in block_steps(x, lo, hi, mask_id, None if block.quotas is None else len(block.quotas)):
            busy = has_mask(x, lo, hi, mask_id)
            decoded = x != mask_id  # at this pass's input
            kind = pass_kind(i, reload_every)
            if kind == "cached":
                assert torch.equal(held, decoded_before), "the cache holds what was decoded at the last input"
                queries = torch.nonzero(~decoded_before).flatten()
                out = net.run(x, queries, kv)
                kv = [(k.clone(), v.clone()) for k, v in kv]
                for layer, (k, v) in enumerate(kv):  # the recomputed rows that are decoded now join the cache
                    k[queries], v[queries] = out.keys[layer], out.values[layer]
                logits = torch.full((L, out.logits.shape[-1]), float("nan"), dtype=out.logits.dtype)
                logits[queries] = out.logits  # only the recomputed positions have logits (the block's masks do)
                cached = torch.nonzero(decoded_before).flatten()
            else:
                queries, cached = everything, torch.tensor([], dtype=torch.long)
                out = net.run(x)
                logits = out.logits
                if kind != "full":
                    kv = list(zip(out.keys, out.values))
            if kind != "full":
                held = decoded.clone()
            commits = block.commit(x, lo, hi, logits[lo:hi], i)
            log.add(kind, b, i, queries, commits, busy, cached=tuple(int(j) for j in cached),
                    kept=tuple(int(j) for j in torch.nonzero(held).flatten()))
            decoded_before = decoded
    return log.result(x)
