"""What the four caches' loops share: the commit rules, the per-pass log, the result, running a batch row by row,
and the loop without a cache they reduce to.

Commit rules (frozen dataclasses holding their settings; each is called on one block's logits and candidates):
    Threshold(0.9)       Fast-dLLM's get_transfer_index with a threshold: the most confident candidate always,
                         plus every other candidate whose float64 softmax confidence is >= threshold
    LowConfidence(32)    LLaDA's schedule: `steps` per generation, steps // num_blocks passes per block, the
                         top get_num_transfer_tokens[i] candidates at the block's pass i (float64 softmax,
                         argmax of the logits); `LowConfidence.dllm_cache(steps)` is dLLM-Cache's own generate
                         (fp32 softmax, argmax taken over exp(logits))
    DInferThreshold(0.9) dInfer's ThresholdParallelDecoder (get_transfer_index_threshold): every candidate whose
                         prediction is not the mask id and whose confidence is >= min(top - 1e-5, threshold)
Every rule takes `exclude_ids` from the loop: ids never predicted (the argmax skips them) that keep their softmax
share (this project's loop never predicts the mask id: pass (mask_id,)). Default: none, as the authors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, NamedTuple, Protocol, Sequence

import torch


# ------------------------------------------------------------------------------------------------ commit rules


def predict(logits: torch.Tensor, exclude_ids: Sequence[int], softmax_dtype: torch.dtype = torch.float64,
            argmax_of_exp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(pred [W], conf [W]) of block logits [W, V]: the argmax (the excluded ids never win, lowest id on ties) and
    its softmax probability in `softmax_dtype` (the excluded ids keep their share)."""
    scored = logits.exp() if argmax_of_exp else logits
    if len(exclude_ids):
        scored = scored.clone()
        scored[:, list(exclude_ids)] = -float("inf")
    pred = scored.argmax(dim=-1)
    p = torch.softmax(logits.to(softmax_dtype), dim=-1)
    return pred, p.gather(-1, pred[:, None])[:, 0]


def num_transfer_tokens(masks: int, steps: int) -> list[int]:
    """LLaDA's get_num_transfer_tokens for one row: `masks` spread over `steps`, the remainder on the first ones."""
    base, rem = divmod(masks, steps)
    return [base + (i < rem) for i in range(steps)]


class CommitRule(Protocol):
    def quotas(self, masks: int, num_blocks: int) -> list[int] | None:
        """Commits per pass of a block holding `masks` masks (LLaDA's schedule), or None (no schedule)."""

    def select(self, logits: torch.Tensor, candidates: torch.Tensor, quota: int | None, *,
               exclude_ids: Sequence[int], mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block logits [W, V], candidates [W] bool, this pass's quota -> (pred [W], commit [W] bool)."""


@dataclass(frozen=True)
class Threshold:
    """Fast-dLLM's threshold rule (their get_transfer_index with `threshold`; dInfer's get_transfer_index too)."""

    threshold: float = 0.9

    def quotas(self, masks, num_blocks):
        return None

    def select(self, logits, candidates, quota, *, exclude_ids, mask_id):
        pred, conf = predict(logits, exclude_ids)
        conf = torch.where(candidates, conf, -float("inf"))
        commit = torch.zeros_like(candidates)
        n = int(candidates.sum())
        if n:
            order = torch.topk(conf, k=n).indices  # as theirs: top-n, then ranks >= 1 below the threshold dropped
            commit[order[0]] = True
            commit[order[1:][conf[order[1:]] >= self.threshold]] = True
        return pred, commit


@dataclass(frozen=True)
class LowConfidence:
    """LLaDA's low-confidence schedule: `steps` for the whole generation (a multiple of the number of blocks)."""

    steps: int
    softmax_dtype: torch.dtype = torch.float64
    argmax_of_exp: bool = False

    @classmethod
    def dllm_cache(cls, steps: int) -> "LowConfidence":
        """As dLLM-Cache's utils/generate_function.py computes it: fp32 softmax, argmax over logits.exp()."""
        return cls(steps, torch.float32, True)

    def quotas(self, masks, num_blocks):
        if self.steps % num_blocks:
            raise ValueError(f"steps={self.steps} must be a multiple of the {num_blocks} blocks")
        return num_transfer_tokens(masks, self.steps // num_blocks)

    def select(self, logits, candidates, quota, *, exclude_ids, mask_id):
        pred, conf = predict(logits, exclude_ids, self.softmax_dtype, self.argmax_of_exp)
        conf = torch.where(candidates, conf, -float("inf"))
        commit = torch.zeros_like(candidates)
        k = min(int(quota or 0), int(candidates.sum()))
        if k:
            commit[torch.topk(conf, k=k).indices] = True
        return pred, commit


@dataclass(frozen=True)
class DInferThreshold:
    """dInfer's ThresholdParallelDecoder.decode (`use_float64`: its class default is False, fp32)."""

    threshold: float = 0.9
    use_float64: bool = True

    def quotas(self, masks, num_blocks):
        return None

    def select(self, logits, candidates, quota, *, exclude_ids, mask_id):
        pred, conf = predict(logits, exclude_ids, torch.float64 if self.use_float64 else torch.float32)
        allowed = candidates & (pred != mask_id)  # a prediction of the mask id never commits
        conf = torch.where(allowed, conf, -float("inf"))
        bar = (conf.max() - 1e-5).clamp(-1000, self.threshold)  # near-ties of the top all commit
        return pred, allowed & (conf >= bar)


class BlockRule:
    """A rule bound to one block: its quotas (if it has a schedule) and the commit of one pass into the canvas."""

    def __init__(self, rule: CommitRule, masks: int, num_blocks: int, exclude_ids: Sequence[int], mask_id: int):
        self.rule, self.exclude_ids, self.mask_id = rule, tuple(exclude_ids), mask_id
        self.quotas = rule.quotas(masks, num_blocks)

    def commit(self, x: torch.Tensor, lo: int, hi: int, block_logits: torch.Tensor, step: int) -> tuple[int, ...]:
        """Commit into the canvas x [L] (in place) from the logits [hi - lo, V] of the block [lo, hi) at the
        block's pass `step`; -> the committed canvas positions."""
        candidates = x[lo:hi] == self.mask_id
        quota = None if self.quotas is None else (self.quotas[step] if step < len(self.quotas) else 0)
        pred, commit = self.rule.select(block_logits, candidates, quota, exclude_ids=self.exclude_ids,
                                        mask_id=self.mask_id)
        commit &= candidates
        x[lo:hi] = torch.where(commit, pred, x[lo:hi])
        return tuple(lo + int(j) for j in torch.nonzero(commit).flatten())


def stuck(step: int, block_length: int) -> None:
    """Raise when a block runs far more passes than it can need: a rule that commits at least one candidate a
    decode fills a block in block_length decodes (two passes each at most), unless its commits keep writing the mask
    id (the authors' loops then never end: a model whose argmax is the mask id; pass exclude_ids=(mask_id,))."""
    if step > 4 * block_length + 8:
        raise RuntimeError(f"no progress after {step} passes in a block of {block_length}: the commits keep writing "
                           "the mask id (exclude_ids=(mask_id,) never predicts it)")


def block_steps(x: torch.Tensor, lo: int, hi: int, mask_id: int, fixed: int | None) -> Iterator[int]:
    """The authors' loop header for one block: `fixed` passes (LLaDA's `for i in range(steps)`, which runs its
    passes whether or not they commit), or passes while the block [lo, hi) holds a mask (Fast-dLLM's)."""
    i = 0
    while (i < fixed) if fixed is not None else bool((x[lo:hi] == mask_id).any()):
        stuck(i, hi - lo)
        yield i
        i += 1


# ------------------------------------------------------------------------------------------------ log and result


@dataclass(frozen=True)
class PassLog:
    """One forward pass of one row.

    kind     what the pass was (per cache: "full", "refresh", "window", "cached", ...; see each loop)
    block    the block being decoded; step: the pass's index within that block's loop (0, 1, ...)
    queries  canvas positions run as queries through every layer this pass (for dllm_cache: the parts refreshed
             by the schedule in layers >= 1; layer 0 always runs every position)
    commits  canvas positions committed from this pass's logits
    busy     whether the block held a mask at the pass's input (False: a pass the loop runs on a full block)
    detail   per cache (see each loop's docstring)
    """

    kind: str
    block: int
    step: int
    queries: tuple[int, ...]
    commits: tuple[int, ...]
    busy: bool
    detail: Mapping[str, object] = field(default_factory=dict)


class CacheResult(NamedTuple):
    x: torch.Tensor  # [P+G] the canvas: prompt then generated tokens
    nfe: int  # every forward pass, as the authors count them
    busy_nfe: int  # passes whose block held a mask at their input (the authors' no-op passes left out)
    log: list[PassLog]


class Log:
    """Collects a row's PassLogs and counts them."""

    def __init__(self):
        self.passes: list[PassLog] = []

    def add(self, kind, block, step, queries, commits, busy, **detail) -> None:
        q = tuple(int(i) for i in queries)
        self.passes.append(PassLog(kind, block, step, q, tuple(commits), bool(busy), detail))

    def result(self, x: torch.Tensor) -> CacheResult:
        return CacheResult(x, len(self.passes), sum(p.busy for p in self.passes), self.passes)


def canvas(prompt: torch.Tensor, gen_length: int, block_length: int, mask_id: int) -> tuple[torch.Tensor, int, int]:
    """(x [P+G]: the prompt then masks, P, number of blocks); prompt [P] is one row without padding."""
    if prompt.dim() != 1:
        raise ValueError("one row at a time: prompt [P] (run a batch with per_row)")
    if gen_length % block_length:
        raise ValueError(f"gen_length={gen_length} must be a multiple of block_length={block_length}")
    P = prompt.shape[0]
    x = torch.full((P + gen_length,), mask_id, dtype=torch.long)
    x[:P] = prompt
    return x, P, gen_length // block_length


def has_mask(x: torch.Tensor, lo: int, hi: int, mask_id: int) -> bool:
    return bool((x[lo:hi] == mask_id).any())


# ------------------------------------------------------------------------------------------------ batches


class BatchResult(NamedTuple):
    x: torch.Tensor  # [B, P+G] left-padded prompts (as given) then each row's generated tokens
    nfe: list[int]  # [B]
    busy_nfe: list[int]
    logs: list[list[PassLog]]  # per row; positions in a row's log are that row's unpadded canvas indices


def per_row(loop: Callable[..., CacheResult], net, prompts: torch.Tensor, attention_mask: torch.Tensor | None = None,
            **settings) -> BatchResult:
    """Run `loop` on each row of a left-padded batch alone (its padding dropped: positions count real tokens).
    The check's definition: a row of a batch equals its B=1 run (none of the authors' batched loops does this)."""
    B, P = prompts.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(prompts, dtype=torch.bool)
    rows = []
    for r in range(B):
        keep = attention_mask[r].bool()
        if keep.any() and not bool(keep[int(keep.float().argmax()):].all()):
            raise ValueError(f"row {r} is not left-padded")
        rows.append(loop(net, prompts[r][keep], **settings))
    G = settings["gen_length"]
    x = torch.cat([prompts.long(), torch.zeros(B, G, dtype=torch.long)], dim=1)
    for r, res in enumerate(rows):
        x[r, P:] = res.x[res.x.shape[0] - G:]
    return BatchResult(x, [r.nfe for r in rows], [r.busy_nfe for r in rows], [r.log for r in rows])


# ------------------------------------------------------------------------------------------------ without a cache


@torch.no_grad()
def no_cache(net, prompt: torch.Tensor, *, gen_length: int, block_length: int, mask_id: int, rule: CommitRule,
             exclude_ids: Sequence[int] = ()) -> CacheResult:
    """Every pass runs the whole canvas (LLaDA's / Fast-dLLM's `generate`): what each cache reduces to in its
    degenerate settings. Log kind "full"."""
    x, P, num_blocks = canvas(prompt, gen_length, block_length, mask_id)
    log, everything = Log(), range(x.shape[0])
    for b in range(num_blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        block = BlockRule(rule, int((x[lo:hi] == mask_id).sum()), num_blocks, exclude_ids, mask_id)
        for i in block_steps(x, lo, hi, mask_id, None if block.quotas is None else len(block.quotas)):
            busy = has_mask(x, lo, hi, mask_id)
            logits = net.run(x).logits
            log.add("full", b, i, everything, block.commit(x, lo, hi, logits[lo:hi], i), busy)
    return log.result(x)
