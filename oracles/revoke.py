"""Eager PyTorch oracles for three published decoding loops that REVOKE commits (remask decoded tokens).

For tests only, as the other `reference_*` modules: plain Python loops, batch 1, greedy (temperature 0),
float64 softmax, sharing no code with the JAX decode loop. Each function transcribes, in its own words,
the semantics of the authors' function as read in their public code (not their paper):

  * WINO (Hong et al., "Wide-In, Narrow-Out: Revokable Decoding for Efficient and Effective DLLMs"):
    Feng-Hong/WINO-DLLM `LLaDA/decoding.py::decoding_wino` (commit 84964c7); the identical copy in
    zhaoyMa/Saber `decoding.py` (both stored versions) was compared line by line. The model it calls is
    LLaDA's modelling file as modified by those repositories (zhaoyMa/Saber `modeling_llada.py`): a 4D
    boolean `attention_mask` [B, 1, L, L] goes straight to `F.scaled_dot_product_attention` (True = the
    query sees the key) and explicit `position_ids` index the RoPE tables.
  * Saber (Dong, Ma et al., "Saber: Efficient Sampling with Adaptive Acceleration and Backtracking Enhanced
    Remasking for Diffusion Language Model"): zhaoyMa/Saber `decoding.py::generate_with_saber`, both
    stored versions (commit 49579a9: remask count uses ceil(fix / 8); commit c4caa28: ceil(fix / mu) with
    a `mu=2` argument). `mu` is a keyword here, default 8 as in 49579a9.
  * ReMDM-style loop: zhaoyMa/Saber `decoding.py::generate_with_remdm` (the baseline Saber compares with;
    both stored versions identical). Its evaluation script calls it with loop_steps=32; the API here
    keeps loop_steps=4 as its default.

Papers: only their abstracts, summaries and the public ICLR review of WINO were at hand; nothing there
contradicts the code (WINO's review notes, as the code does, that a copy position still sees the rest of the
block). The code is followed throughout. Note that the "ReMDM" here is the Saber repository's deterministic,
confidence-ordered baseline, not the stochastic remasking sampler of the ReMDM paper (Wang et al., 2025).

Conventions shared by the three (read from the code, then fixed where the code leaves them open):
  * pred = argmax of the head over the whole vocabulary (the authors exclude nothing: the mask id and any
    padded rows can be predicted); `predict_mask=False` / `vocab_limit=` exclude them from the argmax
    only (their softmax share stays), as `reference_torch.eager_generate` does. argmax ties: lowest id.
  * p = softmax of the logits in float64 (WINO does this; Saber and ReMDM take the softmax in the model's
    dtype, bf16 in their runs: a precision difference only). conf = p[pred].
  * Every torch.topk of the authors is a selection "k largest (or smallest) among a candidate set"; torch
    leaves the order of equal values unspecified, so here ties go to the LOWER canvas position. Where the
    authors' topk would also return -inf / +inf filler entries (fewer candidates than k), the filler is
    dropped (see each rule: with the authors' counts this never happens, except in Saber with n >= 3 near a
    block's end, where the authors' result then depends on which filler torch returns).
  * NFE: all three count one per model forward pass (WINO's `step`, Saber's `step`, ReMDM's `steps`);
    `RevokeResult.nfe` is that count. No rule here has EOS handling: generation always fills the whole
    gen_length (no early stop, no EOS suppression).
  * `RevokeResult.log` has one entry per forward pass, in order: {"pass": i, "block": b, "committed":
    [absolute positions committed after that pass], "remasked": [absolute positions remasked after it]}.

The small rule pieces (`wino_max_accept`, `wino_remask_count`, `saber_threshold`, `saber_remask_count`,
`remdm_remask_score`) are module functions so that a test can swap one for a broken variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids LongTensor [1, L] -> logits [1, L, V], bidirectional
MaskedLogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (ids [1, L'], attention [1, 1, L', L'] bool (query sees key), position_ids [1, L']) -> logits [1, L', V]


@dataclass
class RevokeResult:
    tokens: list[int]  # prompt + generated
    nfe: int  # forward passes, counted as the authors count them (one per model call)
    remasks: int  # tokens taken back in total
    commits: int  # tokens committed in total (a position committed twice counts twice)
    log: list[dict] = field(default_factory=list)  # per pass: {"pass", "block", "committed", "remasked"}


# ------------------------------------------------------------------------------------------------ shared pieces


def _check_prompt(prompt: Sequence[int], mask_id: int) -> list[int]:
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt is empty")
    if mask_id in prompt:
        raise ValueError("the prompt holds the mask id: the published loops treat every mask in the canvas as open")
    return prompt


def _score(logits: torch.Tensor, *, mask_id: int, predict_mask: bool, vocab_limit: int | None):
    """logits [T, V] -> (pred [T] int64, p [T, V] float64) as NumPy arrays."""
    z = logits.detach().to(device="cpu", dtype=torch.float64)
    p = torch.softmax(z, dim=-1)
    choosable = z.clone()
    if not predict_mask:
        choosable[:, mask_id] = -float("inf")
    if vocab_limit is not None:
        choosable[:, vocab_limit:] = -float("inf")
    pred = choosable.argmax(dim=-1)  # first maximum: the lowest id on ties
    return pred.numpy().astype(np.int64), p.numpy()


def _pick(cand: np.ndarray, values: np.ndarray, k: int, *, largest: bool) -> np.ndarray:
    """The (at most) k candidates with the largest / smallest values; ties to the lower position. Sorted."""
    cand = np.asarray(cand, dtype=np.int64)
    values = np.asarray(values, dtype=np.float64)
    k = max(0, min(int(k), len(cand)))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    key = -values if largest else values
    order = np.lexsort((cand, key))  # primary: key ascending, then position ascending
    return np.sort(cand[order[:k]])


def _ids(x: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.int64))[None, :]


def _logits_2d(out: torch.Tensor, length: int) -> torch.Tensor:
    if out.ndim != 3 or out.shape[0] != 1 or out.shape[1] != length:
        raise ValueError(f"logits function returned shape {tuple(out.shape)}, expected [1, {length}, V]")
    return out[0]


def _entry(i: int, b: int, committed, remasked) -> dict:
    return {"pass": i, "block": b, "committed": sorted(int(j) for j in committed),
            "remasked": sorted(int(j) for j in remasked)}


# ------------------------------------------------------------------------------------------------ WINO


def wino_mask(prompt_len: int, gen_length: int, block_start: int, block_length: int, *,
              copy_sees: str = "copy") -> tuple[torch.Tensor, torch.Tensor]:
    """WINO's extended-canvas attention mask [1, 1, L+B, L+B] (bool, True = query sees key) and position ids
    [1, L+B] for one block, L = prompt_len + gen_length, B = block_length, block_start = the block's first
    ABSOLUTE canvas position (prompt_len + b * B).

    As `decoding_wino` builds them (once per block): the canvas [0, L) is followed by a copy of the block
    [L, L+B) that holds mask tokens and carries the block's position ids (block_start ... block_start+B-1).
      * no query of the canvas sees any copy position (the canvas rows are a plain bidirectional pass);
      * copy row k sees every canvas position except its own original block_start + k (all of the prompt,
        the other block positions, and every later still-masked position too);
      * copy row k sees the WHOLE copy, itself included (`copy_sees="copy"`, the authors' choice), so a copy
        position also attends to B-1 extra mask tokens sitting at the other block positions.
    `copy_sees="self"` (not the authors') lets a copy row see only its own copy position.

    What "held out" means here (tests/test_reference_revoke.py checks each point): the canvas rows are
    exactly a plain bidirectional pass. In a ONE-layer model, copy row k with `copy_sees="self"` (and the
    authors' mask when B = 1) is exactly position block_start + k of a plain pass in which that position
    holds the mask; the authors' copy (B > 1) differs from that by the B - 1 other copy mask tokens it also
    attends to. With more layers the copy is held out at the first layer only: from the second layer on,
    copy row k attends to the other canvas positions, whose hidden states were computed with the token at
    block_start + k visible, so that token still moves copy row k's score (the authors' code and paper only
    keep the copy from attending to its own original directly).
    """
    P, G, B = int(prompt_len), int(gen_length), int(block_length)
    L = P + G
    if B <= 0 or not (P <= block_start and block_start + B <= L):
        raise ValueError(f"block [{block_start}, {block_start + B}) is not inside the generated region [{P}, {L})")
    if copy_sees not in ("copy", "self"):
        raise ValueError(f"copy_sees={copy_sees!r}: 'copy' (the authors') or 'self'")
    T = L + B
    attn = torch.ones(T, T, dtype=torch.bool)
    attn[:, L:] = False
    attn[L:, L:] = torch.ones(B, B, dtype=torch.bool) if copy_sees == "copy" else torch.eye(B, dtype=torch.bool)
    attn[L:, block_start:block_start + B] = ~torch.eye(B, dtype=torch.bool)
    pos = torch.cat([torch.arange(L), torch.arange(block_start, block_start + B)])
    return attn[None, None], pos[None]


def wino_max_accept(n_open: int, ratio: float = 0.7, lo: int = 5, hi: int = 20) -> int:
    """Wide-in's cap on commits per pass: min(max(int(ratio * n_open), lo), hi), int() truncating, n_open = how
    many positions are open (masked) up to the block's end before the pass. The authors hard-code 0.7, 5, 20."""
    return min(max(int(n_open * ratio), lo), hi)


def wino_remask_count(n_below: int, last_accept: int) -> int:
    """Narrow-out's count: all n_below decoded block tokens whose held-out probability is < threshold_back,
    unless n_below >= last_accept (the number committed by the block's previous pass; 30 before its first):
    then last_accept - 1 of them (the lowest). So at most last_accept - 1 remasks a pass."""
    return n_below if n_below < last_accept else last_accept - 1


@torch.no_grad()
def wino_generate(masked_logits_fn: MaskedLogitsFn, prompt: Sequence[int], *, mask_id: int, gen_length: int,
                  block_length: int, threshold: float = 0.6, threshold_back: float = 0.9, temperature: float = 0.0,
                  accept_ratio: float = 0.7, min_accept: int = 5, max_accept: int = 20, initial_last_accept: int = 30,
                  predict_mask: bool = True, vocab_limit: int | None = None,
                  max_passes: int | None = None) -> RevokeResult:
    """WINO (`decoding_wino`), greedy. Blocks left to right; in block b ([lo, hi) = P + b*B ... P + (b+1)*B):

    `open` = canvas positions < hi holding the mask (set once at the block's start, then kept by the loop, as
    the authors' `mask_index_block`); `held` = the block positions decoded so far (their `unmask_index_block`,
    empty at the block's start); last_accept = initial_last_accept (30). While any position is open, one pass:
      1. cap = wino_max_accept(#open) = min(max(int(0.7 * #open), 5), 20);
      2. one forward pass of [canvas, B masks] with `wino_mask` (the held-out copy rides in the same pass);
         pred/conf at the canvas rows; back[k] = p(copy row k)[the token held at lo + k] for each held k;
      3. wide-in: accept the open positions with conf > threshold (strict); if more than cap, the cap with
         the highest conf; if none, the single highest conf (first maximum: lowest position);
      4. narrow-out, only if more than one was accepted in step 3: the held positions (decoded BEFORE this
         pass: this pass's accepts are not candidates) with back < threshold_back (strict) are remasked, but
         if there are >= last_accept of them, only the last_accept - 1 with the lowest back
         (`wino_remask_count`);
      5. commit the accepts (x = pred), remask (x = mask), update open / held; last_accept = #accepted.
    The block ends when nothing up to its end is open. NFE = the number of passes (the authors' `step`, the
    sum over blocks of `block_step`). No EOS handling. Ties: lower position first (torch leaves them open).

    Keywords beyond the brief's signature: temperature (only 0), the four constants the authors hard-code
    (accept_ratio=0.7, min_accept=5, max_accept=20, initial_last_accept=30), predict_mask / vocab_limit
    (see the module docstring), and max_passes (not the authors': their loop has no bound; this one raises
    RuntimeError past max_passes, default 50 * (G + B) + 100, which the authors' rule never reaches: a block
    takes at most B passes, since a pass commits >= 1, remasks at most the previous pass's commits - 1 and
    the first pass of a block remasks nothing, so after T passes at most B - T positions are open).
    The returned tokens are the canvas [0, L) (the copy is dropped).
    """
    if temperature != 0.0:
        raise NotImplementedError("greedy only (temperature 0)")
    prompt = _check_prompt(prompt, mask_id)
    P, G, B = len(prompt), int(gen_length), int(block_length)
    if G <= 0 or B <= 0 or G % B:
        raise ValueError(f"gen_length {G} must be a positive multiple of block_length {B}")
    L = P + G
    x = np.array(prompt + [mask_id] * G, dtype=np.int64)
    copy = np.full(B, mask_id, dtype=np.int64)
    log: list[dict] = []
    nfe = commits = remasks = 0
    guard = 50 * (G + B) + 100 if max_passes is None else int(max_passes)
    for b in range(G // B):
        lo, hi = P + b * B, P + (b + 1) * B
        attn, pos = wino_mask(P, G, lo, B)
        open_ = x[:hi] == mask_id
        held = ~open_[lo:hi].copy()
        last_accept = int(initial_last_accept)
        while open_.any():
            cap = wino_max_accept(int(open_.sum()), accept_ratio, min_accept, max_accept)
            logits = _logits_2d(masked_logits_fn(_ids(np.concatenate([x, copy])), attn, pos), L + B)
            nfe += 1
            if nfe > guard:
                raise RuntimeError(f"WINO loop did not finish within {guard} passes")
            pred, p = _score(logits, mask_id=mask_id, predict_mask=predict_mask, vocab_limit=vocab_limit)
            cand = np.flatnonzero(open_)
            conf = p[cand, pred[cand]]
            above = conf > threshold
            if above.sum() > cap:
                accept = _pick(cand, conf, cap, largest=True)
            elif not above.any():
                accept = cand[[int(np.argmax(conf))]]  # first maximum
            else:
                accept = cand[above]
            held_k = np.flatnonzero(held)
            if len(accept) > 1 and len(held_k):
                back = p[L + held_k, x[lo + held_k]]
                below = back < threshold_back
                r = wino_remask_count(int(below.sum()), last_accept)
                remask_k = _pick(held_k[below], back[below], r, largest=False)
            else:
                remask_k = np.zeros(0, dtype=np.int64)
            x[accept] = pred[accept]
            x[lo + remask_k] = mask_id
            open_[accept] = False
            open_[lo + remask_k] = True
            in_block = accept[(accept >= lo) & (accept < hi)]
            held[in_block - lo] = True
            held[remask_k] = False
            last_accept = len(accept)
            commits += len(accept)
            remasks += len(remask_k)
            log.append(_entry(nfe - 1, b, accept, lo + remask_k))
    return RevokeResult(tokens=[int(t) for t in x], nfe=nfe, remasks=remasks, commits=commits, log=log)


# ------------------------------------------------------------------------------------------------ Saber


def saber_threshold(final_conf: np.ndarray, committed: np.ndarray, end: int) -> float:
    """Saber's adaptive threshold: the mean, over every position < end ever committed, of the confidence it had
    when last committed (`final_confidence`; the authors never clear it on remask, so `committed` is not
    read); 1.0 when nothing was ever committed (then only the top-n rule commits)."""
    seen = final_conf[:end][np.isfinite(final_conf[:end])]
    return float(seen.mean()) if seen.size else 1.0


def saber_remask_count(n: int, fix: int, mu: int = 8) -> int:
    """max(n // 2, ceil(fix / mu)), at most fix - 1, fix = max(n, #committed this pass). The authors write
    max(int(n/2), (fix + 7) // 8) (49579a9) or max(int(n/2), (fix + mu - 1) // mu), mu=2 (c4caa28)."""
    k = max(n // 2, -(-fix // mu))
    return min(k, fix - 1)


@torch.no_grad()
def saber_generate(logits_fn: LogitsFn, prompt: Sequence[int], *, mask_id: int, gen_length: int, block_length: int,
                   n: int = 2, mu: int = 8, temperature: float = 0.0, max_steps_per_block: int = 1024,
                   predict_mask: bool = True, vocab_limit: int | None = None) -> RevokeResult:
    """Saber (`generate_with_saber`), greedy. State over the whole run: `committed` (their
    `global_transfer_index`), `final_conf` (confidence at each position's latest commit, -inf if never),
    `last_conf` (the previous pass's confidences, zeros before the first pass). Block b has end = P+(b+1)*B;
    up to max_steps_per_block (1024) passes per block, each:
      1. plain bidirectional forward of the canvas; pred, pconf = p[pred] at every position, pconf = -inf at
         positions >= end; conf = pconf at generated positions, -inf at the prompt;
      2. delta = conf - last_conf where both are finite, +inf otherwise (so at a new block's first pass its
         positions get +inf, and in block 0's first pass delta = conf); then last_conf = conf. delta is
         the change in the ARGMAX probability (not in the probability of the token held);
      3. threshold = `saber_threshold` (mean final_conf over everything ever committed, never cleared on
         remask; 1.0 if none); commit every uncommitted generated position < end (earlier blocks included)
         with conf > threshold (strict); if fewer than n, the n with the highest conf instead (top-n; if
         fewer than n are uncommitted, all of them: the authors' topk would add -inf fillers, dropped here,
         see below);
         fix = max(n, #committed this pass); x = pred there, final_conf = pconf there;
      4. if every generated position is committed: return (no remask); if no position < end holds the mask:
         the block ends (no remask in its last pass);
      5. else remask `saber_remask_count(n, fix, mu)` = min(max(n // 2, ceil(fix / mu)), fix - 1) decoded
         generated positions < end (earlier blocks included, and this pass's commits too), those with the
         lowest delta (most dropped; +inf last; ties to the lower position); they become uncommitted.
    NFE = passes (the authors' `step`). No EOS handling. If a block runs out of its step budget the loop goes
    on to the next block with masks left (as the authors'); the result may then hold masks.

    The one place the authors' code is not determined: when fewer than n positions up to `end` are still
    uncommitted, `torch.topk(confidence, k=n)` returns -inf entries too, and which ones torch leaves open; a
    prompt position picked so gets its confidence into `final_confidence` (and so into later thresholds), a
    committed one is overwritten with the current argmax, a later-block one is committed early. Here those
    fillers are dropped. With n = 2 (the default) and B >= 2 it cannot happen: a pass that does not end the
    block leaves at least (its remask count) >= 1 masked, plus the ones it did not commit, and a block starts
    with B masked, so fewer than 2 masked never occurs before the block's last pass; with n >= 3 it can.
    Keywords beyond the brief's signature: mu (8; see `saber_remask_count`), temperature (only 0),
    max_steps_per_block (the authors' `range(1024)`), predict_mask / vocab_limit (module docstring).
    """
    if temperature != 0.0:
        raise NotImplementedError("greedy only (temperature 0)")
    if n < 1:
        raise ValueError("n must be >= 1")
    prompt = _check_prompt(prompt, mask_id)
    P, G, B = len(prompt), int(gen_length), int(block_length)
    if G <= 0 or B <= 0 or G % B:
        raise ValueError(f"gen_length {G} must be a positive multiple of block_length {B}")
    L = P + G
    x = np.array(prompt + [mask_id] * G, dtype=np.int64)
    gen = np.zeros(L, dtype=bool)
    gen[P:] = True
    idx = np.arange(L)
    committed = np.zeros(L, dtype=bool)
    final_conf = np.full(L, -np.inf)
    last_conf = np.zeros(L)
    log: list[dict] = []
    nfe = commits = remasks = 0
    for b in range(G // B):
        end = P + (b + 1) * B
        for _ in range(max_steps_per_block):
            logits = _logits_2d(logits_fn(_ids(x)), L)
            nfe += 1
            pred, p = _score(logits, mask_id=mask_id, predict_mask=predict_mask, vocab_limit=vocab_limit)
            pconf = p[idx, pred]
            pconf[end:] = -np.inf
            conf = np.where(gen, pconf, -np.inf)
            with np.errstate(invalid="ignore"):
                delta = conf - last_conf
            delta[~np.isfinite(delta)] = np.inf
            last_conf = conf
            cand = np.flatnonzero(gen & ~committed & (idx < end))
            threshold = saber_threshold(final_conf, committed, end)
            sel = cand[conf[cand] > threshold]
            if len(sel) < n:
                sel = _pick(cand, conf[cand], n, largest=True)
            fix = max(n, len(sel))
            x[sel] = pred[sel]
            committed[sel] = True
            final_conf[sel] = pconf[sel]
            commits += len(sel)
            if committed[gen].all() or (x[:end] != mask_id).all():
                log.append(_entry(nfe - 1, b, sel, ()))
                if committed[gen].all():
                    return RevokeResult(tokens=[int(t) for t in x], nfe=nfe, remasks=remasks, commits=commits, log=log)
                break
            decoded = np.flatnonzero(gen & (idx < end) & (x != mask_id))
            rem = _pick(decoded, delta[decoded], saber_remask_count(n, fix, mu), largest=False)
            x[rem] = mask_id
            committed[rem] = False
            remasks += len(rem)
            log.append(_entry(nfe - 1, b, sel, rem))
    return RevokeResult(tokens=[int(t) for t in x], nfe=nfe, remasks=remasks, commits=commits, log=log)


# ------------------------------------------------------------------------------------------------ ReMDM-style


def remdm_remask_score(p: np.ndarray, x: np.ndarray, held: np.ndarray) -> np.ndarray:
    """ReMDM's remask score of the held positions `held`: the probability of the token each one HOLDS."""
    return p[held, x[held]]


@torch.no_grad()
def remdm_generate(logits_fn: LogitsFn, prompt: Sequence[int], *, mask_id: int, gen_length: int,
                   init_unmask_ratio: float = 0.875, unmask_k: int = 1, loop_steps: int = 4, temperature: float = 0.0,
                   block_length: int | None = None, predict_mask: bool = True,
                   vocab_limit: int | None = None) -> RevokeResult:
    """ReMDM-style loop of the Saber repository (`generate_with_remdm`), greedy, over the whole canvas (no
    blocks: the authors' `block_length` argument is accepted and ignored, as theirs is). k = unmask_k.
      0. G * r must be an integer, G % k == 0 and (G * r) % k == 0 (the authors assert these);
      1. G * r / k passes: commit the k masked positions with the highest conf (x = pred);
      2. loop_steps times, if some generated position is decoded (else the iteration is skipped: no pass):
         k' = min(k, #decoded); one pass scoring each decoded position by the probability of the token it
         holds (`remdm_remask_score`); remask the k' lowest; then a SECOND pass on the remasked canvas and
         commit the k' masked positions with the highest conf (anywhere, the just-remasked ones included);
      3. while anything is masked: one pass, commit min(k, #masked) with the highest conf.
    NFE = every forward pass, the remask-scoring ones included (the authors' `steps`):
    G*r/k + 2*loop_steps + ceil(G*(1-r)/k) when G*r > 0. Ties: the lower position first. No EOS handling.
    The authors' `tokenizer.decode` calls each pass have no effect on the result and are left out.
    """
    if temperature != 0.0:
        raise NotImplementedError("greedy only (temperature 0)")
    prompt = _check_prompt(prompt, mask_id)
    P, G, k = len(prompt), int(gen_length), int(unmask_k)
    if not 0.0 <= init_unmask_ratio <= 1.0:
        raise ValueError("init_unmask_ratio must be between 0 and 1")
    n_init = G * init_unmask_ratio
    if n_init != int(n_init):
        raise ValueError("gen_length * init_unmask_ratio must be an integer")
    n_init = int(n_init)
    if k < 1 or G % k or n_init % k:
        raise ValueError("gen_length and gen_length * init_unmask_ratio must be divisible by unmask_k")
    L = P + G
    x = np.array(prompt + [mask_id] * G, dtype=np.int64)
    gen = np.zeros(L, dtype=bool)
    gen[P:] = True
    log: list[dict] = []
    counts = {"nfe": 0, "commits": 0, "remasks": 0}

    def forward():
        logits = _logits_2d(logits_fn(_ids(x)), L)
        counts["nfe"] += 1
        return _score(logits, mask_id=mask_id, predict_mask=predict_mask, vocab_limit=vocab_limit)

    def commit_top(kk: int) -> None:
        masked = np.flatnonzero(x == mask_id)
        pred, p = forward()
        sel = _pick(masked, p[masked, pred[masked]], kk, largest=True)
        x[sel] = pred[sel]
        counts["commits"] += len(sel)
        log.append(_entry(counts["nfe"] - 1, 0, sel, ()))

    for _ in range(n_init // k):
        if not (x == mask_id).any():
            break
        commit_top(k)
    for _ in range(loop_steps):
        held = np.flatnonzero(gen & (x != mask_id))
        if len(held) == 0:
            continue
        kk = min(k, len(held))
        pred, p = forward()
        rem = _pick(held, remdm_remask_score(p, x, held), kk, largest=False)
        x[rem] = mask_id
        counts["remasks"] += len(rem)
        log.append(_entry(counts["nfe"] - 1, 0, (), rem))
        commit_top(kk)
    while (x == mask_id).any():
        commit_top(min(k, int((x == mask_id).sum())))
    return RevokeResult(tokens=[int(t) for t in x], nfe=counts["nfe"], remasks=counts["remasks"],
                        commits=counts["commits"], log=log)


# ------------------------------------------------------------------------------------------------ model adapters


def logits_fn_from_model(model) -> LogitsFn:
    """A `LogitsFn` from a transformers causal-LM class run bidirectionally (an all-ones 4D boolean mask)."""
    from oracles.bidirectional import bidirectional_logits

    def fn(ids: torch.Tensor) -> torch.Tensor:
        return bidirectional_logits(model, ids.to(model.device))

    return fn


def masked_logits_fn_from_model(model) -> MaskedLogitsFn:
    """A `MaskedLogitsFn` from a transformers causal-LM class with SDPA attention: the boolean 4D mask (True =
    the query sees the key) and the position ids are passed as they are, as `reference_torch` does."""

    @torch.no_grad()
    def fn(ids: torch.Tensor, attention: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        dev = model.device
        return model(input_ids=ids.to(dev), attention_mask=attention.to(dev, torch.bool),
                     position_ids=position_ids.to(dev)).logits

    return fn


def llada_fns(hf_config: Mapping, tensors: Mapping[str, torch.Tensor], dtype=torch.float32,
              device: str = "cpu") -> tuple[LogitsFn, MaskedLogitsFn]:
    """(LogitsFn, MaskedLogitsFn) for LLaDA weights run as transformers' LlamaForCausalLM
    (`reference_torch.llama_from_llada`)."""
    from oracles.bidirectional import llama_from_llada

    model = llama_from_llada(hf_config, tensors, dtype=dtype, device=device)
    return logits_fn_from_model(model), masked_logits_fn_from_model(model)
