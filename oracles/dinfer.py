"""An eager oracle of dInfer's decoding (inclusionAI/dInfer): its threshold, credit and hierarchy decoders, under
its block runners, with or without iteration smoothing; one prompt at a time, greedy. For tests only; it shares no
code with the library (torch and numpy, never localleap_jax).

What was read (public code, transcribed here in our own words, not copied), at fce4e32804103baa5d55230dff0352da0cdd6ceb
(the decoders unchanged since 0f8abdb):
  * `python/dinfer/decoding/parallel_strategy.py`: `get_transfer_index_threshold` and ThresholdParallelDecoder
    (264-312), CreditThresholdParallelDecoder (314-390), HierarchyDecoder (418-498, `get_transfer_index`);
  * `python/dinfer/decoding/generate_uniform.py`: BlockRunner.decode (68-117: the unrolled calls), the block
    diffusion runner's decode (its unroll of at least two calls), BaseDiffusionIteration (no cache),
    BlockWiseDiffusionLLM.generate (431-489), IterationSmooth and IterSmoothDiffusionLLM (491-602);
  * `python/dinfer/model/modeling_llada2_moe.py` `H2Embed` (203-282: softmax(logits / tau) @ W_e, blended at the
    masked positions with weight w, tau 1); `python/dinfer/decoding/utils.py` (`add_gumbel_noise` is the identity
    at temperature 0; BlockIterator starts at the prompt's end unless `start_block_align`);
  * ../shared/reference/dinfer-decoders.md (the facts, with the quirks listed there).

## The decoders, one block of one row, each call (x0, p: argmax and its softmax probability, fp32)
  threshold  candidates: masked positions whose x0 is not the mask id; commit p >= min(best candidate p - 1e-5,
             threshold) (clamped below at -1000). No candidate: nothing commits.
  credit     before the threshold rule: the block's credit matrix C [T, V] (fp32, zero at the block's first call)
             is multiplied by decay_beta from the block's second call on; at each masked position the raw argmax's
             entry gains p1 ** boost_gamma; the rule then runs on logits + credit_alpha * log(1 + C) and writes ITS
             argmax. The matrices are dropped once the canvas holds no mask (a new block has a new key anyway).
  hierarchy  confidence p at masked positions; segments = runs of consecutive masked positions; commit a segment's
             maximum (ties: all) if p > low_threshold (None: no floor), any p > threshold (None: none), and the
             block's most confident masked position (first on ties); the mask id is written where it is x0 (no
             change).

## The runners
  whole canvas ("bidirectional")  blocks of the generated region from the prompt's end; every call runs the whole
                                  canvas; a block is worked on in rounds of max(min(masks // expected_tpf,
                                  maximum_unroll), 1) calls, checking for masks only between rounds.
  block diffusion                 blocks on the grid from position 0 (the prompt's tail in the first decoded block),
                                  the canvas rounded up to whole blocks, block-causal logits (`logits_fn(x[:end])`,
                                  the attention-mask runner without a cache); rounds of max(min(.., ..), 2) calls.
  Both stop after the first block that holds EOS (whatever early_stop says); early_stop also fills the rest of the
  canvas with EOS. A round's calls on a block already full change nothing for the three decoders but are counted
  (`forwards`: dInfer's num_forwards); `passes` counts the calls made while the block still held a mask (the
  project's NFE).

## Iteration smoothing (IterSmoothDiffusionLLM, whole canvas, no cache)
  t counts every call of the generation (unrolled ones included). Call t decides with threshold max(1 - t *
  threshold_decay, threshold); the next call's input is E[x] everywhere plus w_t * softmax(logits_t) @ E at the
  positions still masked after call t (the whole canvas), w_t = min(cont_weight_init + t * cont_weight_growth,
  cont_weight). The first call's input is E[x].

`never_predict`: ids left out of every argmax (they keep their softmax share): the project never writes ids past
its tokenizer's vocabulary; give the oracle the same. dInfer's argmax may be the mask id (the decoders handle it as
above). A call that commits nothing leaves the block as it was: where every masked position's argmax is the mask id
dInfer would loop forever; the oracle raises instead (`Stuck`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

LogitsFn = Callable[[np.ndarray], np.ndarray]  # ids [1, n] -> logits [1, n, V]
EmbedsFn = Callable[[torch.Tensor], torch.Tensor]  # input embeddings [1, n, D] -> logits [1, n, V]


class Stuck(RuntimeError):
    """A call on a block with masks changed nothing and would repeat forever (dInfer's loop never ends); `result`:
    what was decoded up to it."""

    def __init__(self, message: str, result: "DInferResult"):
        super().__init__(message)
        self.result = result


def _argmax(logits: torch.Tensor, never_predict: Sequence[int]) -> torch.Tensor:
    if len(never_predict):
        logits = logits.clone()
        logits[..., list(never_predict)] = -torch.inf
    return torch.argmax(logits, dim=-1)


# ------------------------------------------------------------------------------------------------ decoders


@dataclass
class ThresholdDecoder:
    threshold: float

    def block_start(self):
        pass

    def transfer(self, logits: torch.Tensor, masked: torch.Tensor, iter_threshold: float | None,
                 never_predict: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens to write [T], which positions commit [T] bool) on a block's logits [T, V]."""
        threshold = self.threshold if iter_threshold is None else iter_threshold
        x0 = _argmax(logits, never_predict)
        p = torch.softmax(logits.to(torch.float32), dim=-1).gather(-1, x0[:, None])[:, 0]
        candidates = masked & (x0 != self.mask_id)
        confidence = torch.where(candidates, p, torch.tensor(-torch.inf))
        bound = (confidence.max() - 1e-5).clamp(-1000, threshold)  # in fp32, as dInfer's tensor clamp
        return x0, candidates & (confidence >= bound)


@dataclass
class CreditDecoder(ThresholdDecoder):
    credit_alpha: float = 0.7
    boost_gamma: float = 0.2
    decay_beta: float = 0.8
    matrix: torch.Tensor | None = None
    calls: int = 0
    fused_differs: int = field(default=0)  # commits whose fused argmax is not the raw argmax (tests decide their case)

    def block_start(self):
        self.matrix, self.calls = None, 0

    def transfer(self, logits, masked, iter_threshold, never_predict):
        T, V = logits.shape
        if self.matrix is None:
            self.matrix = torch.zeros((T, V), dtype=torch.float32)
        if self.calls > 0:
            self.matrix.mul_(self.decay_beta)
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        top1 = _argmax(probs, never_predict)
        gain = probs.gather(-1, top1[:, None])[:, 0].pow(self.boost_gamma) * masked.to(torch.float32)
        self.matrix.scatter_add_(1, top1[:, None], gain[:, None])
        self.calls += 1
        fused = logits + self.credit_alpha * torch.log(self.matrix + 1)
        x0, commit = super().transfer(fused, masked, iter_threshold, never_predict)
        self.fused_differs += int((commit & (x0 != _argmax(logits, never_predict))).sum())
        return x0, commit


@dataclass
class HierarchyDecoder:
    threshold: float | None = None
    low_threshold: float | None = 0.4
    segment_only: int = 0  # commits by a segment's maximum alone: not > threshold, not the best (for tests)

    def block_start(self):
        pass

    def transfer(self, logits, masked, iter_threshold, never_predict):
        threshold = self.threshold if iter_threshold is None else iter_threshold
        T = logits.shape[0]
        x0 = _argmax(logits, never_predict)
        p = torch.log_softmax(logits, dim=-1).gather(-1, x0[:, None])[:, 0].exp()
        lowest = torch.finfo(p.dtype).min
        confidence = torch.where(masked, p, torch.tensor(lowest, dtype=p.dtype))
        commit = torch.zeros(T, dtype=torch.bool)
        i = 0
        while i < T:  # each maximal run of masked positions
            if not masked[i]:
                i += 1
                continue
            j = i
            while j < T and masked[j]:
                j += 1
            top = confidence[i:j] == confidence[i:j].max()
            if self.low_threshold is not None:
                top &= confidence[i:j] > self.low_threshold
            commit[i:j] |= top
            i = j
        by_segment = commit.clone()
        if threshold is not None:
            commit |= confidence > threshold
        best = int(torch.argmax(confidence))
        commit[best] = True
        others = by_segment & masked & ~(confidence > threshold if threshold is not None else False)
        others[best] = False
        self.segment_only += int(others.sum())
        return x0, commit & masked


def make_decoder(name: str, *, mask_id: int, **settings):
    cls = {"threshold": ThresholdDecoder, "credit": CreditDecoder, "hierarchy": HierarchyDecoder}[name]
    decoder = cls(**settings)
    decoder.mask_id = mask_id
    return decoder


# ------------------------------------------------------------------------------------------------ the runner


@dataclass
class Smoothing:
    """IterationSmooth's settings, and what it needs of the model: `embeds_fn` (input embeddings -> logits over the
    whole canvas) and the input embedding table [V, D]."""

    embeds_fn: EmbedsFn
    embedding: torch.Tensor
    cont_weight: float = 0.3
    cont_weight_init: float = 0.15
    cont_weight_growth: float = 0.02
    threshold_decay: float = 0.02


@dataclass
class DInferResult:
    tokens: np.ndarray  # the canvas (prompt, then the generated region; a block grid's tail included)
    forwards: int  # dInfer's num_forwards: every model call, unrolled ones on a full block included
    passes: int  # calls made while their block held a mask (the project's NFE)
    passes_per_block: list[int] = field(default_factory=list)
    stopped: bool = False  # a block held EOS: the runner stopped after it
    log: list[dict] = field(default_factory=list)  # per call: block, call, committed positions (absolute), tokens


def _blocks(P: int, gen_length: int, T: int, layout: str) -> tuple[int, list[tuple[int, int]]]:
    if layout == "bidirectional":
        if gen_length % T:
            raise ValueError(f"gen_length={gen_length} is not a multiple of block_length={T}")
        return P + gen_length, [(P + b * T, P + (b + 1) * T) for b in range(gen_length // T)]
    if layout != "block_diffusion":
        raise ValueError(f"layout={layout!r}; choose bidirectional or block_diffusion")
    n = -(-(P + gen_length) // T)
    return n * T, [(b * T, (b + 1) * T) for b in range(P // T, n)]


def generate(logits_fn: LogitsFn | None, prompt: Sequence[int] | np.ndarray, *, decoder, mask_id: int, eos_id: int,
             gen_length: int, block_length: int, layout: str = "bidirectional", early_stop: bool = True,
             maximum_unroll: int = 4, expected_tpf: int = 8, smoothing: Smoothing | None = None,
             never_predict: Sequence[int] = ()) -> DInferResult:
    """dInfer's generate for one prompt (see the module docstring). `decoder`: `make_decoder(...)`. `smoothing`:
    IterSmoothDiffusionLLM over the decoder (whole canvas only; `logits_fn` is then unused)."""
    prompt = np.asarray(prompt, np.int64)
    if prompt.ndim != 1 or not prompt.size or (prompt == mask_id).any():
        raise ValueError("prompt: non-empty 1-D ids without the mask id")
    if smoothing is not None and layout != "bidirectional":
        raise ValueError("iteration smoothing runs on the whole-canvas runner (a bidirectional model)")
    P, T = prompt.size, block_length
    length, blocks = _blocks(P, gen_length, T, layout)
    x = np.full(length, mask_id, np.int64)
    x[:P] = prompt
    least = 1 if layout == "bidirectional" else 2  # calls per round: the whole-canvas runner's and the block runner's
    out = DInferResult(tokens=x, forwards=0, passes=0)
    t = 0  # smoothing's call counter (the whole generation's)
    embeds = None if smoothing is None else smoothing.embedding[torch.as_tensor(x)][None]
    for b, (lo, hi) in enumerate(blocks):
        decoder.block_start()
        passes = 0
        while (x[lo:hi] == mask_id).any():
            rounds = max(min(int((x[lo:hi] == mask_id).sum()) // expected_tpf, maximum_unroll), least)
            for _ in range(rounds):
                masked = torch.as_tensor(x[lo:hi] == mask_id)
                had_mask = bool(masked.any())
                iter_threshold = None
                if smoothing is None:
                    end = length if layout == "bidirectional" else hi
                    logits_all = torch.as_tensor(np.array(logits_fn(x[None, :end].copy()))[0])
                else:
                    iter_threshold = max(1 - t * smoothing.threshold_decay, decoder.threshold)
                    weight = min(smoothing.cont_weight_init + smoothing.cont_weight_growth * t, smoothing.cont_weight)
                    logits_all = smoothing.embeds_fn(embeds)[0]
                x0, commit = decoder.transfer(logits_all[lo:hi], masked, iter_threshold, never_predict)
                new = np.where(commit.numpy(), x0.numpy(), x[lo:hi])
                if had_mask and (new == x[lo:hi]).all():
                    raise Stuck(f"block {b}: a call changed nothing (every masked argmax is the mask id?)", out)
                x[lo:hi] = new
                out.forwards += 1
                passes += had_mask
                out.log.append({"block": b, "call": passes - 1, "committed": (lo + np.flatnonzero(commit)).tolist(),
                                "had_mask": had_mask})
                if smoothing is not None:
                    still = torch.as_tensor(x == mask_id)
                    soft = torch.softmax(logits_all, dim=-1) @ smoothing.embedding
                    base = smoothing.embedding[torch.as_tensor(x)]
                    embeds = torch.where(still[:, None], weight * soft + base, base)[None]
                    t += 1
        out.passes += passes
        out.passes_per_block.append(passes)
        if (x[lo:hi] == eos_id).any():
            if early_stop:
                x[hi:] = eos_id
            out.stopped = True
            break
    return out
