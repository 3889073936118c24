"""Fast-dLLM's LLaDA decoding loops (NVlabs/Fast-dLLM, llada/generate.py), transcribed onto transformers' Llama.

The oracle for `ll.generate(..., DecodeConfig(cache="none" | "prefix" | "dual"))` and the PyTorch baseline of
the decode benchmarks. Torch only; it deliberately shares no code with `model.py` or `decode/` (the model is
`reference_torch.llama_from_llada`, transformers' LlamaForCausalLM holding LLaDA's weights).

    out = generate(model, prompt, gen_length=64, block_length=16, mask_id=m, threshold=0.9)
    out = generate_with_prefix_cache(model, prompt, ..., rule=reference_rules.make("localleap"))
    out = generate_with_dual_cache(model, prompt, ..., steps=32)       # LLaDA's top-k schedule
    out.x [B, P+G], out.nfe (Fast-dLLM's count: forward passes of the batch), out.row_nfe, out.full_passes

The three loops, as published:

    generate                    every pass runs the whole canvas x [B, P+G]
    generate_with_prefix_cache  per block: one full pass (it commits), whose K/V are kept up to the block's
                                start; later passes run x[:, start:] and attend to the kept prefix K/V
                                followed by their own
    generate_with_dual_cache    per block: one full pass (it commits), whose K/V are all kept; later passes
                                run only x[:, start:end], their K/V replace the kept ones at the block's
                                positions (`replace_position`), and they attend to the whole kept K/V

Kept as published: rows advance through blocks together (a block ends when no row has a mask left in it, so a
row that filled its block waits, committing nothing); `nfe` counts forward passes of the batch; logits of
every position the pass runs, and a float64 softmax over them; the prediction is the argmax; the commit rule
is their `get_transfer_index` with `remasking="low_confidence"`: LLaDA's per-block top-k schedule
(`steps`), or with `threshold` the most confident candidate plus every candidate at or above the threshold.

What differs, each an equivalent or an opt-in extension:
- The model: transformers' Llama run bidirectionally with a boolean 4D mask and explicit `position_ids`
  (LLaDA's modeling code passes no mask and numbers positions 0..L-1: the same without padding).
- The K/V cache is a transformers `Cache` (`KVCache`) whose `update` records, extends or replaces. Keys are
  kept after RoPE at their positions; Fast-dLLM keeps them before RoPE and rotates every key at every pass:
  the same numbers up to rounding. `replace_position` is the slice [start, end), the same for every row, as
  their loop builds it (their per-row scatter writes those positions).
- `attention_mask` (left padding): padding keys are masked and positions count real tokens. Fast-dLLM's loops
  take no mask (equal-length prompts only).
- `rule=`: any commit rule of `reference_rules` (one eager copy per row, reset when the batch enters a block,
  its step the row's working passes in the block), e.g. LocalLeap's anchor rule, so the same loops give "the
  PyTorch LocalLeap loop with a dual cache".
- `exclude_ids`: ids never predicted that keep their softmax share (this project's loop contract never
  predicts the mask token). Default: none, as published.
- Greedy only (their temperature > 0 draws Gumbel noise from torch's generator; nothing to compare).
- `row_nfe` (passes in which each row had a candidate: `ll.generate`'s per-row NFE) and `full_passes` are
  counted besides their `nfe`.

Needs torch and transformers (`pip install -e .[test]`). LLaDA only (no Dream shift).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, Protocol, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache


class FastResult(NamedTuple):
    x: torch.Tensor  # [B, P+G] the canvas: prompt then generated tokens
    nfe: int  # Fast-dLLM's count: forward passes the batch ran
    row_nfe: list[int]  # [B] passes in which each row still had a candidate (it committed)
    full_passes: int  # of which ran the whole canvas


# ------------------------------------------------------------------------------------------- commit rules


def num_transfer_tokens(block_masks: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's get_num_transfer_tokens: each row's masks [B, T] spread over `steps`, remainder first -> [B, steps]."""
    count = block_masks.sum(dim=1, keepdim=True)
    base, rem = count // steps, count % steps
    out = base.expand(-1, steps).clone()
    out += (torch.arange(steps, device=block_masks.device)[None, :] < rem).to(out.dtype)
    return out


def predict(logits: torch.Tensor, exclude_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x0 [B, W] argmax, x0_p [B, W] its float64 softmax probability, p [B, W, V] float64), as Fast-dLLM's
    get_transfer_index at temperature 0; `exclude_ids` are never the argmax but keep their softmax share."""
    choosable = logits
    if len(exclude_ids):
        choosable = logits.clone()
        choosable[..., list(exclude_ids)] = -float("inf")
    x0 = torch.argmax(choosable, dim=-1)
    p = torch.softmax(logits.to(torch.float64), dim=-1)
    return x0, torch.gather(p, -1, x0[..., None])[..., 0], p


class Transfer(Protocol):
    """A commit rule as the loops call it (Fast-dLLM's get_transfer_index, with the block made explicit)."""

    def bind(self, *, batch: int, gen_length: int, block_length: int, steps: int,
             exclude_ids: Sequence[int]) -> "Transfer": ...

    def start_block(self, block_masks: torch.Tensor) -> None:
        """The batch enters a block; block_masks [B, T] are its masks."""

    def __call__(self, logits: torch.Tensor, mask_index: torch.Tensor, x: torch.Tensor, i: int, offset: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Window logits [B, W, V], candidates mask_index [B, W] (all inside the block, which starts at window
        column `offset`), the window's tokens x [B, W], the batch's step i in the block ->
        (x0 [B, W]: predictions at candidates, x elsewhere; transfer_index [B, W] bool: what commits)."""


class FastDllmTransfer:
    """Fast-dLLM's get_transfer_index (remasking="low_confidence"): the top num_transfer_tokens[:, i] of LLaDA's
    schedule, or with `threshold` the top-1 plus every candidate whose confidence is not below it."""

    def __init__(self, threshold: float | None = None):
        self.threshold = threshold

    def bind(self, *, batch, gen_length, block_length, steps, exclude_ids):
        self.steps_per_block = steps // (gen_length // block_length)
        self.exclude_ids = tuple(exclude_ids)
        return self

    def start_block(self, block_masks):
        self.schedule = num_transfer_tokens(block_masks, self.steps_per_block)

    def __call__(self, logits, mask_index, x, i, offset):
        x0, x0_p, _ = predict(logits, self.exclude_ids)
        x0 = torch.where(mask_index, x0, x)
        confidence = torch.where(mask_index, x0_p, -np.inf)
        transfer = torch.zeros_like(x0, dtype=torch.bool)
        k = mask_index.sum(dim=1) if self.threshold is not None else self.schedule[:, i]
        for j in range(confidence.shape[0]):  # per row, as theirs: top-k, then drop ranks >= 2 under threshold
            _, picked = torch.topk(confidence[j], k=int(k[j]))
            transfer[j, picked] = True
            if self.threshold is not None:
                transfer[j, picked[1:][confidence[j, picked[1:]] < self.threshold]] = False
        return x0, transfer


class EagerRule:
    """Any `reference_rules` rule in the loops' place of get_transfer_index: one eager copy per row (reset when
    the batch enters a block), called on the block's candidates with the row's working passes as its step."""

    def __init__(self, rule):
        self.rule = rule

    def bind(self, *, batch, gen_length, block_length, steps, exclude_ids):
        from oracles import rules as reference_rules

        self.rule.bind(gen_length=gen_length, block_length=block_length)
        self.rows = [reference_rules.fresh(self.rule) for _ in range(batch)]
        self.block_length, self.exclude_ids = block_length, tuple(exclude_ids)
        return self

    def start_block(self, block_masks):
        for r in self.rows:
            r.reset()
        self.row_steps = [0] * len(self.rows)

    def __call__(self, logits, mask_index, x, i, offset):
        from oracles import rules as reference_rules

        x0, x0_p, p = predict(logits, self.exclude_ids)
        blk = slice(offset, offset + self.block_length)
        # Only the block's [B, T] signals leave the device (whole distributions only for a rule that reads them).
        cand_h, pred_h, conf_h = (t[:, blk].cpu().numpy() for t in (mask_index, x0, x0_p))
        pb = p[:, blk] if set(self.rule.reads) & {"probs", "margin", "entropy"} else None
        transfer = np.zeros(mask_index.shape, bool)
        for r, row in enumerate(self.rows):
            cand = np.flatnonzero(cand_h[r])
            if not cand.size:  # the row filled its block: it waits
                continue
            probs = pb[r].cpu().numpy() if pb is not None else None
            extra = {}
            if "margin" in row.reads:
                extra["margin"] = reference_rules.margin_of(probs)
            if "entropy" in row.reads:
                extra["entropy"] = reference_rules.entropy_of(probs)
            commits = row.select(self.row_steps[r], cand, probs, pred_h[r], conf_h[r], **extra)
            transfer[r, offset + np.fromiter(commits, int)] = True
            self.row_steps[r] += 1
        return torch.where(mask_index, x0, x), torch.from_numpy(transfer).to(mask_index.device)


def _transfer(rule, threshold, steps, *, batch, gen_length, block_length, exclude_ids) -> Transfer:
    if rule is not None and threshold is not None:
        raise ValueError("give threshold= (Fast-dLLM's rule) or rule=, not both")
    if rule is None:
        t = FastDllmTransfer(threshold)
    elif hasattr(rule, "start_block"):  # already a Transfer
        t = rule
    else:
        t = EagerRule(rule)
    return t.bind(batch=batch, gen_length=gen_length, block_length=block_length, steps=steps,
                  exclude_ids=exclude_ids)


# ------------------------------------------------------------------------------------------- the model


class KVCache(Cache):
    """Every layer's K/V of a block's full pass, and how a later pass's K/V join them (transformers' Cache API).

    mode "record":  store what the pass computes (the full pass) and attend to it
    mode "prefix":  attend to the kept K/V [:start] followed by the pass's own (the pass runs x[:, start:])
    mode "replace": write the pass's K/V over the kept ones at [start, end) and attend to all of them
                    (Fast-dLLM's replace_position: the pass runs x[:, start:end])
    K/V are [B, H_kv, L, Dh], after RoPE.
    """

    def __init__(self):
        super().__init__(layers=[])
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mode, self.span = "record", (0, 0)

    def keep_prefix(self, start: int) -> "KVCache":
        self.keys = [k[:, :, :start] for k in self.keys]
        self.values = [v[:, :, :start] for v in self.values]
        self.mode = "prefix"
        return self

    def replace_at(self, start: int, end: int) -> "KVCache":
        self.mode, self.span = "replace", (start, end)
        return self

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.mode == "record":
            self.keys.append(key_states)
            self.values.append(value_states)
            return key_states, value_states
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.mode == "prefix":  # as theirs: cat(past, new) every pass, the kept prefix itself never changes
            return torch.cat((k, key_states), dim=-2), torch.cat((v, value_states), dim=-2)
        lo, hi = self.span  # in place, as their replace_position writes into past_key_values
        k[:, :, lo:hi] = key_states
        v[:, :, lo:hi] = value_states
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[-2] if self.keys else 0

    def __len__(self) -> int:  # layers held (Cache counts its `layers`, which this class does not use)
        return len(self.keys)


def _cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.x); pass whichever this version takes."""
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def _logits(model, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
            cache: KVCache | None = None) -> torch.Tensor:
    """Logits [B, Q, V] of the window ids [B, Q] at `positions` [B, Q], every query seeing every real key
    (key_mask [B, K]: the cache's keys then, for prefix, the window's; K = L for every pass here)."""
    B, Q = ids.shape
    attn = key_mask[:, None, None, :].expand(B, 1, Q, key_mask.shape[1])  # boolean 4D: bidirectional
    kw = {_cache_kwarg(model): cache, "use_cache": True} if cache is not None else {"use_cache": False}
    return model(input_ids=ids, attention_mask=attn, position_ids=positions, **kw).logits


def _canvas(prompt, attention_mask, gen_length, mask_id):
    """x [B, P+G] (prompt then masks), key_mask [B, P+G] bool, positions [B, P+G] (real tokens counted)."""
    B, P = prompt.shape
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :P] = prompt
    if attention_mask is None:
        attention_mask = torch.ones_like(prompt, dtype=torch.bool)
    key_mask = torch.cat([attention_mask.bool(), torch.ones(B, gen_length, dtype=torch.bool, device=x.device)], 1)
    positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    return x, key_mask, positions


class _Counter:
    """nfe as theirs (batch passes), and per row the passes in which it had a candidate (on device: no sync)."""

    def __init__(self, B, device):
        self.nfe = self.full = 0
        self.rows = torch.zeros(B, dtype=torch.long, device=device)

    def pass_(self, mask_index: torch.Tensor, full: bool):
        self.nfe += 1
        self.full += int(full)
        self.rows += mask_index.any(dim=1)

    def result(self, x) -> FastResult:
        return FastResult(x, self.nfe, self.rows.tolist(), self.full)


def _setup(model, prompt, attention_mask, steps, gen_length, block_length, mask_id, threshold, rule, exclude_ids):
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    steps = gen_length if steps is None else steps
    assert steps % num_blocks == 0
    x, key_mask, positions = _canvas(prompt, attention_mask, gen_length, mask_id)
    transfer = _transfer(rule, threshold, steps, batch=x.shape[0], gen_length=gen_length,
                         block_length=block_length, exclude_ids=exclude_ids)
    return x, key_mask, positions, transfer, num_blocks, _Counter(x.shape[0], x.device)


# ------------------------------------------------------------------------------------------- the loops


@torch.no_grad()
def generate(model, prompt: torch.Tensor, attention_mask: torch.Tensor | None = None, *, gen_length: int,
             block_length: int, mask_id: int, steps: int | None = None, threshold: float | None = None,
             rule=None, exclude_ids: Sequence[int] = ()) -> FastResult:
    """Fast-dLLM's `generate` (no cache): every pass runs the whole canvas. prompt [B, P] -> FastResult."""
    x, key_mask, positions, transfer, num_blocks, count = _setup(
        model, prompt, attention_mask, steps, gen_length, block_length, mask_id, threshold, rule, exclude_ids)
    P = prompt.shape[1]
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        transfer.start_block(x[:, start:end] == mask_id)
        i = 0
        while True:  # at least one pass per block, the test after it
            mask_index = x == mask_id
            logits = _logits(model, x, positions, key_mask)
            mask_index[:, end:] = False
            count.pass_(mask_index, full=True)
            x0, t = transfer(logits, mask_index, x, i, start)
            x[t] = x0[t]
            i += 1
            if not (x[:, start:end] == mask_id).any():
                break
    return count.result(x)


@torch.no_grad()
def generate_with_prefix_cache(model, prompt: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                               gen_length: int, block_length: int, mask_id: int, steps: int | None = None,
                               threshold: float | None = None, rule=None, exclude_ids: Sequence[int] = ()
                               ) -> FastResult:
    """Fast-dLLM's `generate_with_prefix_cache`. prompt [B, P] -> FastResult.

    Per block: a full pass (it commits) whose K/V are kept up to the block's start; then, until the block has
    no mask, passes over x[:, start:] (the block and everything after it) attending to the kept prefix."""
    x, key_mask, positions, transfer, num_blocks, count = _setup(
        model, prompt, attention_mask, steps, gen_length, block_length, mask_id, threshold, rule, exclude_ids)
    P = prompt.shape[1]
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        transfer.start_block(x[:, start:end] == mask_id)
        cache = KVCache()
        logits = _logits(model, x, positions, key_mask, cache)
        mask_index = x == mask_id
        mask_index[:, end:] = False
        count.pass_(mask_index, full=True)
        x0, t = transfer(logits, mask_index, x, 0, start)
        x[t] = x0[t]
        cache.keep_prefix(start)
        i = 1
        while (x[:, start:end] == mask_id).any():
            mask_index = x[:, start:] == mask_id
            mask_index[:, block_length:] = False
            logits = _logits(model, x[:, start:], positions[:, start:], key_mask, cache)
            count.pass_(mask_index, full=False)
            x0, t = transfer(logits, mask_index, x[:, start:], i, 0)
            x[:, start:][t] = x0[t]
            i += 1
    return count.result(x)


@torch.no_grad()
def generate_with_dual_cache(model, prompt: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                             gen_length: int, block_length: int, mask_id: int, steps: int | None = None,
                             threshold: float | None = None, rule=None, exclude_ids: Sequence[int] = ()
                             ) -> FastResult:
    """Fast-dLLM's `generate_with_dual_cache`. prompt [B, P] -> FastResult.

    Per block: a full pass (it commits) whose K/V are all kept; then, until the block has no mask, passes over
    x[:, start:end] only, their K/V replacing the kept ones at [start, end), attending to all L kept K/V."""
    x, key_mask, positions, transfer, num_blocks, count = _setup(
        model, prompt, attention_mask, steps, gen_length, block_length, mask_id, threshold, rule, exclude_ids)
    P = prompt.shape[1]
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        transfer.start_block(x[:, start:end] == mask_id)
        cache = KVCache()
        logits = _logits(model, x, positions, key_mask, cache)
        mask_index = x == mask_id
        mask_index[:, end:] = False
        count.pass_(mask_index, full=True)
        x0, t = transfer(logits, mask_index, x, 0, start)
        x[t] = x0[t]
        cache.replace_at(start, end)
        i = 1
        while (x[:, start:end] == mask_id).any():
            mask_index = x[:, start:end] == mask_id
            logits = _logits(model, x[:, start:end], positions[:, start:end], key_mask, cache)
            count.pass_(mask_index, full=False)
            x0, t = transfer(logits, mask_index, x[:, start:end], i, 0)
            x[:, start:end][t] = x0[t]
            i += 1
    return count.result(x)


LOOPS = {"none": generate, "prefix": generate_with_prefix_cache, "dual": generate_with_dual_cache}
