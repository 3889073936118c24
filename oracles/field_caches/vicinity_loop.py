"""dInfer's vicinity refresh (inclusionAI/dInfer @ fce4e32, `python/dinfer/decoding/generate_uniform.py`
`VicinityCacheIteration.forward`, `BlockRunner.decode`, `BlockWiseDiffusionLLM.generate`; `utils.py`
`DiffusionKVCacheManager.require_update`, `KVCache.update`, `BlockIterator`), one row, eagerly. See the package
doc."""

from __future__ import annotations

from typing import Sequence

import torch

from oracles.field_caches.common import BlockRule, CacheResult, CommitRule, Log, canvas, has_mask, stuck


class CacheManager:
    """DiffusionKVCacheManager's refresh test: it records the block it was asked about, every time it is asked."""

    def __init__(self, refresh_every: int | None):
        self.refresh_every, self.block = refresh_every, None

    def asks_refresh(self, iter_no: int, block: tuple[int, int]) -> bool:
        changed = self.block != block
        self.block = block
        return changed or (self.refresh_every is not None and iter_no % self.refresh_every == 0)


@torch.no_grad()
def vicinity(net, prompt: torch.Tensor, *, gen_length: int, block_length: int, mask_id: int, rule: CommitRule,
             prefix_look: int = 16, after_look: int = 16, warmup: int = 4, refresh_every: int | None = None,
             exclude_ids: Sequence[int] = ()) -> CacheResult:
    """dInfer's VicinityCacheDiffusionLLM on one row (prompt [P], unpadded) -> CacheResult, with maximum_unroll=1
    (one iteration between two "is the block full" tests), early_stop=False and blocks from the prompt's end
    (start_block_align=False, the class default).

    iter_no counts every pass of the generation. While iter_no < warmup an iteration is one full pass without any
    cache. Afterwards an iteration is [a refresh pass] then a window pass. The refresh pass (whole canvas, it
    decodes the block and keeps every position's keys/values) runs when there is no cache yet, or when the
    manager asks for one (block changed since it was last asked, or iter_no % refresh_every == 0) in a block
    after the first. The manager is not asked on the iteration that builds the first cache (their `or`
    short-circuits), and in block 0 it is asked but not obeyed. The window pass runs [max(0, start -
    prefix_look), min(L, end + after_look)) fresh over the kept keys/values elsewhere (its own are not kept) and
    decodes the block, even when the refresh pass just filled it. The rule's step is the block's decode count.

    Log: kind "warmup", "refresh" or "window"; queries: the positions run; detail: "iter_no" (at the pass's start).
    """
    if prefix_look < 0 or after_look < 0 or warmup < 0 or (refresh_every is not None and refresh_every < 1):
        raise ValueError("prefix_look, after_look, warmup >= 0; refresh_every None or >= 1")
    x, P, num_blocks = canvas(prompt, gen_length, block_length, mask_id)
    L = x.shape[0]
    everything = range(L)
    manager, kv, iter_no, log = CacheManager(refresh_every), None, 0, Log()
    for b in range(num_blocks):
        lo, hi = P + b * block_length, min(P + (b + 1) * block_length, L)
        block = BlockRule(rule, int((x[lo:hi] == mask_id).sum()), num_blocks, exclude_ids, mask_id)
        step = 0  # decode calls in this block
        while has_mask(x, lo, hi, mask_id):
            stuck(step, hi - lo)
            if iter_no < warmup:
                logits = net.run(x).logits
                log.add("warmup", b, step, everything, block.commit(x, lo, hi, logits[lo:hi], step), True,
                        iter_no=iter_no)
                iter_no, step = iter_no + 1, step + 1
                continue
            if kv is None or (manager.asks_refresh(iter_no, (lo, hi)) and b > 0):
                out = net.run(x)
                kv = list(zip(out.keys, out.values))
                log.add("refresh", b, step, everything, block.commit(x, lo, hi, out.logits[lo:hi], step), True,
                        iter_no=iter_no)
                iter_no, step = iter_no + 1, step + 1
            w_lo, w_hi = max(0, lo - prefix_look), min(L, hi + after_look)
            busy = has_mask(x, lo, hi, mask_id)
            window = torch.arange(w_lo, w_hi)
            logits = net.run(x, window, kv).logits  # the window's keys/values are not written back
            log.add("window", b, step, window, block.commit(x, lo, hi, logits[lo - w_lo:hi - w_lo], step), busy,
                    iter_no=iter_no)
            iter_no, step = iter_no + 1, step + 1
    return log.result(x)
