"""Eager PyTorch transcriptions of the model authors' Monte-Carlo log-likelihood estimators.

The test oracle for the JAX likelihood code: it shares nothing with it and follows, step by step, what the
authors' lm-eval harnesses do (re-expressed here, not copied):

* LLaDA, `evaluation/eval_llada.py` (ML-GSAI/LLaDA): `_encode_pair`, `_forward_process`, `get_logits`,
  `get_loglikelihood`, `suffix_greedy_prediction`.
* Dream, `eval/eval.py` (HKUNLP/Dream): `_encode_pair`, `_forward_process`, `get_logits`,
  `_eval_target_nll_mc` with `log_type="ftb"`, and the sign flip in `loglikelihood`.

Deliberate differences from the authors' code (none changes what is estimated):
* the randomness comes from an explicit `torch.Generator` (the authors use torch's global one; `None` here
  means the global one too);
* the model is a `LogitsFn` (ids [B, L] -> raw logits [B, L, V]); logits are cast to float32 before the
  guidance combination and the cross-entropy (the authors run bf16), float64 in the exact expectations;
* no `max_length` cutoff in Dream's `_encode_pair`, no device handling, no lm-eval plumbing.

Besides the estimators, `llada_expected_loglikelihood` / `dream_expected_loglikelihood` give their exact
expectations (float64, every mask set enumerated), so a test can check that an implementation estimates
what the authors' estimator estimates.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids LongTensor [B, L] -> raw logits [B, L, V] (unshifted; no padding)

__all__ = [
    "LogitsFn", "llada_encode_pair", "dream_encode_pair", "llada_forward_process", "llada_stratified_counts",
    "llada_minibatch_losses", "llada_loglikelihood", "llada_suffix_greedy", "dream_forward_process",
    "dream_minibatch_losses", "dream_loglikelihood", "llada_expected_loglikelihood",
    "dream_expected_loglikelihood",
]

_CHUNK = 64  # rows per forward pass in the exact expectations


# ---------------------------------------------------------------- tokenisation


def _move_trailing_spaces(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's convention: whitespace at the end of the context belongs to the continuation."""
    stripped = context.rstrip()
    tail = context[len(stripped):]
    return stripped, tail + continuation


def llada_encode_pair(hf_tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """LLaDA's `_encode_pair`: (ids of the context, ids of context+continuation past the context's length).

    Both encodings use the tokenizer's `__call__` with its defaults (special tokens as the tokenizer adds them)."""
    context, continuation = _move_trailing_spaces(context, continuation)
    whole = list(hf_tokenizer(context + continuation)["input_ids"])
    ctx = list(hf_tokenizer(context)["input_ids"])
    return ctx, whole[len(ctx):]


def dream_encode_pair(hf_tokenizer, context: str, continuation: str,
                      add_bos_token: bool = False) -> tuple[list[int], list[int]]:
    """Dream's `_encode_pair` without its max_length cutoff: optional bos text prefix, trailing spaces moved,
    whole = encode(context + continuation) + [eos]; the continuation is whole past len(encode(context)).

    Interpretation: with `add_bos_token` and a tokenizer without a bos token (Dream's own has none) the authors'
    `bos_token + context` raises a TypeError; here a ValueError says why."""
    if add_bos_token:
        if hf_tokenizer.bos_token is None:
            raise ValueError("add_bos_token=True but the tokenizer has no bos_token")
        context = hf_tokenizer.bos_token + context
    context, continuation = _move_trailing_spaces(context, continuation)
    whole = list(hf_tokenizer.encode(context + continuation)) + [hf_tokenizer.eos_token_id]
    ctx = list(hf_tokenizer.encode(context))
    return ctx, whole[len(ctx):]


# ---------------------------------------------------------------- LLaDA


def llada_stratified_counts(k: int, target_len: int, b: int) -> list[int]:
    """The number of masked target tokens l_i of each of the b rows of one mini-batch, given the draw k.

    As LLaDA's `_forward_process`: b float32 points evenly spaced from k to k + (b-1) L/b (the end point
    computed as a 0-d long tensor plus a Python float, i.e. in float32), rounded half to even (torch.round),
    then wrapped into 1..L by ((x - 1) mod L) + 1. Because the grid is float32, exact half-integer ties of
    k + i L / b can land either side when L/b is not a dyadic rational (never for b a power of two)."""
    return _counts(torch.tensor(int(k), dtype=torch.long), target_len, b).tolist()


def _counts(k: torch.Tensor, target_len: int, b: int) -> torch.Tensor:
    """l_i as a long tensor [b] from the 0-d long tensor k (the authors' types, hence float32 arithmetic)."""
    end = k + (b - 1) * (target_len / b)  # 0-d float32 tensor
    x = torch.round(torch.linspace(float(k), end, steps=b)).long()  # half to even
    return ((x - 1) % target_len) + 1


def llada_forward_process(batch: torch.Tensor, prompt_len: int, mask_id: int,
                          generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA's `_forward_process`. batch [b, l] (identical rows, the first prompt_len positions the prompt).

    One draw k ~ U{1..L} (L = l - prompt_len) for the whole mini-batch; row i masks exactly l_i
    (`llada_stratified_counts`) target positions chosen by a uniform random permutation (one per row, drawn in
    row order). Returns (noisy batch [b, l] with masked positions set to mask_id, p_mask [b, l] = l_i / L as
    float32, constant along each row)."""
    b, l = batch.shape
    target_len = l - prompt_len
    if target_len < 1:
        raise ValueError("the target must have at least one token")
    k = torch.randint(1, target_len + 1, (), generator=generator)
    counts = _counts(k, target_len, b)  # [b]
    assert int(counts.min()) >= 1 and int(counts.max()) <= target_len
    # row i: the first counts[i] slots are masked, then the slots are shuffled by a fresh permutation
    slots = torch.arange(target_len).unsqueeze(0).expand(b, target_len) < counts.unsqueeze(1)  # [b, L]
    target_mask = torch.stack([slots[i][torch.randperm(target_len, generator=generator)] for i in range(b)])
    is_mask = torch.cat([torch.zeros(b, prompt_len, dtype=torch.bool), target_mask], dim=1)  # [b, l]
    noisy = torch.where(is_mask, torch.full_like(batch, mask_id), batch)
    p_mask = (counts / target_len).unsqueeze(1).repeat(1, l)  # [b, l] float32
    return noisy, p_mask


def _llada_logits(logits_fn: LogitsFn, batch: torch.Tensor, prompt_len: int, mask_id: int, cfg: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """LLaDA's `get_logits`: with cfg > 0, a second copy of the batch with every prompt position set to the
    mask id gives the unconditional logits, and the result is un + (cfg + 1) (cond - un). [b, l, V]."""
    if cfg > 0.0:
        uncond = batch.clone()
        uncond[:, :prompt_len] = mask_id
        both = logits_fn(torch.cat([batch, uncond])).to(dtype)  # [2b, l, V]
        cond, un = both.chunk(2, dim=0)
        return un + (cfg + 1.0) * (cond - un)
    return logits_fn(batch).to(dtype)


@torch.no_grad()
def llada_minibatch_losses(logits_fn: LogitsFn, prefix: Sequence[int], target: Sequence[int], *, mask_id: int,
                           mc_num: int = 128, batch_size: int = 32, cfg: float = 0.0,
                           generator: torch.Generator | None = None) -> list[float]:
    """The per-mini-batch losses of LLaDA's `get_loglikelihood` (its `loss_acc`): for each of the
    mc_num // batch_size mini-batches, sum over rows and masked positions of CE / p_mask, divided by the
    number of rows. They are i.i.d.; `llada_loglikelihood` is minus their mean."""
    if mc_num % batch_size != 0:
        raise ValueError("LLaDA asserts mc_num % batch_size == 0")
    prompt_len = len(prefix)
    seq = torch.tensor(list(prefix) + list(target), dtype=torch.long)[None, :].repeat(batch_size, 1)  # [b, l]
    losses = []
    for _ in range(mc_num // batch_size):
        noisy, p_mask = llada_forward_process(seq, prompt_len, mask_id, generator)
        masked = noisy == mask_id  # [b, l]; as the authors: any position holding the mask id
        logits = _llada_logits(logits_fn, noisy, prompt_len, mask_id, cfg)  # [b, l, V]
        ce = F.cross_entropy(logits[masked], seq[masked], reduction="none") / p_mask[masked]
        losses.append((ce.sum() / batch_size).item())
    return losses


def llada_loglikelihood(logits_fn: LogitsFn, prefix: list[int], target: list[int], *, mask_id: int,
                        mc_num: int = 128, batch_size: int = 32, cfg: float = 0.0,
                        generator: torch.Generator | None = None) -> float:
    """LLaDA's `get_loglikelihood`: minus the mean of the mini-batch losses."""
    losses = llada_minibatch_losses(logits_fn, prefix, target, mask_id=mask_id, mc_num=mc_num,
                                    batch_size=batch_size, cfg=cfg, generator=generator)
    return -sum(losses) / len(losses)


@torch.no_grad()
def llada_suffix_greedy(logits_fn: LogitsFn, prefix: list[int], target: list[int], *, mask_id: int,
                        cfg: float = 0.0) -> bool:
    """LLaDA's `suffix_greedy_prediction` (with is_check_greedy=True): start from prefix + len(target) masks;
    len(target) times, predict every masked position (argmax) and unmask only the most confident one (float32
    softmax probability of its argmax); True iff the result equals the target.

    Interpretation: the authors take the first index of an unstable descending `torch.sort`; ties (equal
    confidences) go here to the leftmost masked position (a stable sort). As the authors', a position whose
    argmax is the mask id stays masked."""
    prompt_len = len(prefix)
    seq = torch.full((1, prompt_len + len(target)), mask_id, dtype=torch.long)  # [1, l]
    seq[0, :prompt_len] = torch.tensor(list(prefix), dtype=torch.long)
    for _ in range(len(target)):
        masked = seq == mask_id  # [1, l]
        logits = _llada_logits(logits_fn, seq, prompt_len, mask_id, cfg)[masked]  # [m, V]
        pred = logits.argmax(dim=-1)  # [m]
        conf = torch.softmax(logits.float(), dim=-1).gather(-1, pred[:, None]).squeeze(-1)  # [m]
        order = torch.sort(conf, descending=True, stable=True).indices
        pred[order[1:]] = mask_id  # all but the most confident stay masked
        seq[masked] = pred
    return bool(torch.equal(seq[0, prompt_len:], torch.tensor(list(target), dtype=torch.long)))


# ---------------------------------------------------------------- Dream


def dream_forward_process(batch: torch.Tensor, mask_id: int, generator: torch.Generator | None,
                          sampling_eps: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's `_forward_process`. batch [b, l].

    One u0 ~ U[0,1) per mini-batch; row i has t_i = (u0 + i / b) mod 1 and mask probability
    p_i = (1 - eps) t_i + eps (float32); every position is masked independently with probability p_i, except
    sequence positions 0 and l-1, never masked. Returns (noisy batch [b, l], p_mask [b, l])."""
    b, l = batch.shape
    u0 = torch.rand(1, generator=generator, dtype=torch.float32)
    t = (u0 + torch.arange(b).float() / b) % 1  # [b]
    p_mask = ((1 - sampling_eps) * t + sampling_eps)[:, None].repeat(1, l)  # [b, l]
    is_mask = torch.rand((b, l), generator=generator) < p_mask
    is_mask[:, 0] = False
    is_mask[:, -1] = False
    noisy = torch.where(is_mask, torch.full_like(batch, mask_id), batch)
    return noisy, p_mask


def _dream_logits(logits_fn: LogitsFn, batch: torch.Tensor, prompt_len: int, mask_id: int, guidance: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dream's `get_logits`: raw logits shifted right by one (position j reads the model's output at j-1,
    position 0 its own), and with guidance g > 1 the prompt-masked copy gives un + g (cond - un). [b, l, V].

    Interpretation: one copy of eval.py multiplies by an undefined `self.cfg`; the guidance weight is
    `classifier_free_guidance` (as in the copies that fixed it)."""
    if guidance > 1.0:
        uncond = batch.clone()
        uncond[:, :prompt_len] = mask_id
        batch = torch.cat([batch, uncond])
    raw = logits_fn(batch).to(dtype)  # [b or 2b, l, V]
    shifted = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)
    if guidance > 1.0:
        cond, un = shifted.chunk(2, dim=0)
        return un + guidance * (cond - un)
    return shifted


@torch.no_grad()
def dream_minibatch_losses(logits_fn: LogitsFn, prefix: Sequence[int], target: Sequence[int], *, mask_id: int,
                           mc_num: int = 128, batch_size: int = 32, classifier_free_guidance: float = 1.0,
                           sampling_eps: float = 1e-3, generator: torch.Generator | None = None) -> list[float]:
    """The per-mini-batch losses of Dream's `_eval_target_nll_mc` with log_type "ftb" (max(mc_num // b, 1) of
    them): the noise of `dream_forward_process` is kept on the last len(target) positions only, then sum over
    rows and masked positions of CE / p_mask (shifted logits), divided by the number of rows."""
    if len(target) < 1:
        raise ValueError("the target must have at least one token (Dream's ends with EOS)")
    prompt_len = len(prefix)
    seq = torch.tensor(list(prefix) + list(target), dtype=torch.long)[None, :].repeat(batch_size, 1)  # [b, l]
    n_t = len(target)
    losses = []
    for _ in range(max(mc_num // batch_size, 1)):
        noisy_all, p_mask = dream_forward_process(seq, mask_id, generator, sampling_eps)
        noisy = seq.clone()
        noisy[:, -n_t:] = noisy_all[:, -n_t:]  # 'ftb': only the target is noised
        masked = noisy == mask_id  # [b, l]
        logits = _dream_logits(logits_fn, noisy, prompt_len, mask_id, classifier_free_guidance)  # [b, l, V]
        ce = F.cross_entropy(logits[masked], seq[masked], reduction="none") / p_mask[masked]
        losses.append((ce.sum() / batch_size).item())
    return losses


def dream_loglikelihood(logits_fn: LogitsFn, prefix: list[int], target: list[int], *, mask_id: int,
                        mc_num: int = 128, batch_size: int = 32, classifier_free_guidance: float = 1.0,
                        sampling_eps: float = 1e-3, generator: torch.Generator | None = None) -> float:
    """Dream's `loglikelihood` for nll_type "mc", log_type "ftb": minus `_eval_target_nll_mc` (the mean of the
    mini-batch losses). `target` as `dream_encode_pair` returns it (ending with EOS)."""
    losses = dream_minibatch_losses(logits_fn, prefix, target, mask_id=mask_id, mc_num=mc_num,
                                    batch_size=batch_size, classifier_free_guidance=classifier_free_guidance,
                                    sampling_eps=sampling_eps, generator=generator)
    return -(sum(losses) / len(losses))


# ---------------------------------------------------------------- exact expectations


def _subset_ce_sums(logits_at: Callable[[torch.Tensor], torch.Tensor], seq: list[int],
                    subsets: list[tuple[int, ...]], mask_id: int) -> list[float]:
    """S(M) = sum over j in M of CE_j(seq with M masked) in float64, for each subset M of positions; every
    masked sequence is run once, in chunks of _CHUNK rows. `logits_at` maps ids [n, l] -> float64 logits."""
    base = torch.tensor(seq, dtype=torch.long)
    out: list[float] = []
    for start in range(0, len(subsets), _CHUNK):
        part = subsets[start:start + _CHUNK]
        rows = base[None, :].repeat(len(part), 1)  # [n, l]
        for r, m in enumerate(part):
            rows[r, list(m)] = mask_id
        logp = torch.log_softmax(logits_at(rows).double(), dim=-1)  # [n, l, V]
        for r, m in enumerate(part):
            idx = torch.tensor(m, dtype=torch.long)
            out.append(float(-logp[r, idx, base[idx]].sum()))
    return out


def _check_no_mask(seq: list[int], mask_id: int) -> None:
    if mask_id in seq:
        raise ValueError("the exact expectations assume the mask id occurs in neither prefix nor target")


@torch.no_grad()
def llada_expected_loglikelihood(logits_fn: LogitsFn, prefix: list[int], target: list[int], *, mask_id: int,
                                 batch_size: int = 32, cfg: float = 0.0) -> float:
    """The exact expectation of `llada_loglikelihood` (float64; targets of at most 8 tokens):
    -(1/L) sum_k (1/b) sum_i (L / l_i(k)) A(l_i(k)), with A(l) the mean of S(M) over all target subsets M of
    size l. It does not depend on mc_num."""
    L = len(target)
    if not 1 <= L <= 8:
        raise ValueError("exact expectation only for targets of 1..8 tokens")
    seq = list(prefix) + list(target)
    _check_no_mask(seq, mask_id)
    P = len(prefix)
    subsets = [tuple(P + j for j in c) for size in range(1, L + 1) for c in itertools.combinations(range(L), size)]
    sums = _subset_ce_sums(lambda ids: _llada_logits(logits_fn, ids, P, mask_id, cfg, torch.float64),
                           seq, subsets, mask_id)
    mean_by_size = {size: 0.0 for size in range(1, L + 1)}
    for m, s in zip(subsets, sums):
        mean_by_size[len(m)] += s / math.comb(L, len(m))
    total = 0.0
    for k in range(1, L + 1):
        counts = llada_stratified_counts(k, L, batch_size)
        total += sum(L / c * mean_by_size[c] for c in counts) / batch_size
    return -total / L


def _dream_weight(m: int, n: int, eps: float) -> float:
    """E_t[(1/p) p^m (1-p)^(n-m)] for t ~ U(0,1), p = (1-eps) t + eps, m >= 1: the exact integral
    (1/(1-eps)) int_eps^1 p^(m-1) (1-p)^(n-m) dp of a polynomial (p = 1 identically when eps = 1)."""
    if eps >= 1.0:
        return 1.0 if m == n else 0.0
    P = np.polynomial.Polynomial
    poly = P([0.0, 1.0]) ** (m - 1) * P([1.0, -1.0]) ** (n - m)
    anti = poly.integ()
    return float((anti(1.0) - anti(eps)) / (1.0 - eps))


@torch.no_grad()
def dream_expected_loglikelihood(logits_fn: LogitsFn, prefix: list[int], target: list[int], *, mask_id: int,
                                 classifier_free_guidance: float = 1.0, sampling_eps: float = 1e-3) -> float:
    """The exact expectation of `dream_loglikelihood` (float64; targets of at most 8 tokens, EOS included).

    Every row's t is marginally U(0,1) (the mini-batch shares u0, which leaves each row's marginal uniform), so
    E = -sum_{M nonempty} S(M) E_t[p^(|M|-1) (1-p)^(n-|M|)] over subsets M of the n maskable positions: the
    target positions except the sequence's last and, with an empty prefix, except position 0."""
    L = len(target)
    if not 1 <= L <= 8:
        raise ValueError("exact expectation only for targets of 1..8 tokens")
    seq = list(prefix) + list(target)
    _check_no_mask(seq, mask_id)
    P = len(prefix)
    maskable = [j for j in range(P, len(seq)) if j != 0 and j != len(seq) - 1]
    n = len(maskable)
    subsets = [c for size in range(1, n + 1) for c in itertools.combinations(maskable, size)]
    if not subsets:
        return -0.0
    sums = _subset_ce_sums(
        lambda ids: _dream_logits(logits_fn, ids, P, mask_id, classifier_free_guidance, torch.float64),
        seq, subsets, mask_id)
    total = sum(s * _dream_weight(len(m), n, sampling_eps) for m, s in zip(subsets, sums))
    return -total
