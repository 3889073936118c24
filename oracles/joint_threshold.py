"""Eager oracles for token-editing decoding: SGLang's JointThreshold (LLaDA2.1's "T2T + M2T" decoding) and its
insert/delete variant JointThresholdInDel (LLaDA2.2), as plain per-block Python loops over a `logits_fn`.
For tests only; batch 1; shares no code with the library.

What was read (public code, transcribed here, not copied):
  * sgl-project/sglang `python/sglang/srt/dllm/algorithm/joint_threshold.py`, two stored versions:
    @17d57211 (the stateful `step(forward_batch, full_logits, states)` form driven by `DllmAlgorithm._run_sync`,
    `max_steps = block_size + max_post_edit_steps + 1`) and @cabd4543 (the older `run` form that loops itself,
    `max_iterations = block_size + max_post_edit_steps`, then one store forward if the last pass changed
    something). The per-pass rule is the same in both; this module follows @17d57211.
  * sgl-project/sglang `python/sglang/srt/dllm/algorithm/base.py`@0929d6df (`_run_sync`: one forward, then up to
    `max_steps` calls of `step`, a forward after each call that is not all-done; a block with no mask at entry
    returns after one forward).
  * sgl-project/sglang `python/sglang/srt/dllm/algorithm/joint_threshold_indel.py`, two stored versions:
    @0fbe7e46 (transcribed: prompt-aware edit operations, fallback for MASK predictions at original masks, a
    final cleanup pass, `max_steps = block_size + max_post_edit_steps + 2`) and @7c7e7941 (an earlier form:
    no cleanup pass, the budget test `post_edit_steps > max_post_edit_steps`, indel applied to the whole block).
  * LLaDA2.2's report (section 3.1) was NOT found in the stores searched; the indel transcription rests on the
    code alone (see `joint_threshold_indel_generate` for what is not pinned down).

## JointThreshold, one block (SGLang @17d57211 `step`, batch 1)
At block entry the block's non-mask positions are its prompt (the prompt's tail in a block-diffusion model's
first decoded block; none otherwise); they are never edited. Each pass, over the block's logits:
    x = argmax, p = its softmax probability, at every block position (full vocabulary, as SGLang; ties: lowest id)
    masks left:  commit the masks with p > threshold (strict); none passes: the single most confident mask
    no mask:     a post-edit pass; post_edit_steps += 1; if it exceeds max_post_edit_steps the block ENDS here,
                 changing nothing (this pass counts)
    edits, in the same pass (also while masks remain): every position that is neither a mask nor prompt whose
                 argmax differs from its token, with p > edit_threshold (strict: 0 edits every disagreement)
    nothing to commit or edit: the block ENDS (this pass counts)
    else write the commits and edits and run another pass
`penalty_lambda` > 0 (SGLang's repetition penalty, default 0): before the argmax, each block position j >= 1
has penalty_lambda subtracted from the logit of the token at j - 1 (a mask or prompt token included).
Passes are capped at SGLang's max_steps = block_length + max_post_edit_steps + 1; the cap binds only when a
pass commits or edits without changing the count of masks for good (the mask id predicted, or an edit that
writes the mask id back): `result.capped` counts blocks that hit it.

NFE (the issue's definition): every pass, the one that ends the block (changing nothing) and the one on which
the budget runs out included; NOT SGLang's extra forward that stores the finished block's K/V (their loop runs
it because a block's K/V must hold its final tokens; here recomputing the prefix is the same thing). Bound per
block: block_length + max_post_edit_steps + 1 passes (<= T mask passes, <= max_post_edit_steps post-edit
passes that change something, one that ends the block).

Where the blocks are (`layout`):
  * "block_diffusion" (SDAR, LLaDA2): blocks on the absolute grid from position 0, ceil((P + G) / T) of them,
    decoding from block P // T (the prompt's tail shares it and is never edited); `logits_fn(x[:block end])`
    returns block-causal logits and the block's rows are used. SGLang's exact block cache computes the same
    numbers (a finished block's K/V hold its final tokens), so recomputing the prefix is equivalent.
  * "bidirectional" (LLaDA): the canvas is prompt + G masks (G a multiple of T); blocks are the generated
    region's [P + bT, P + (b+1)T); `logits_fn(whole canvas)` every pass (no cache).
The loop stops after a block when `stop_ids` occur in the generated region (optional; SGLang's request-level
stop is outside the algorithm and not transcribed).

Differences from diffusers' LLaDA2 scheduler (its example uses "Q mode" 0.7 / 0.5 / 16), not followed: a 17th
mask-free pass that still edits; no editing pass after the last commit; edit_threshold <= 0 disables editing
(SGLang: 0 edits every disagreement); stop conditions shared by the batch's rows.

Greedy only (SGLang's JointThreshold is argmax already). `never_predict`: ids left out of the argmax that keep
their softmax share (SGLang excludes none; a caller comparing with a loop that never predicts the mask id
passes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

LogitsFn = Callable[[np.ndarray], np.ndarray]  # ids [1, n] -> logits [1, n, V]

S_MODE = {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16}  # SGLang's documented setting
Q_MODE = {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 16}  # diffusers' example
LAYOUTS = ("block_diffusion", "bidirectional")


def _softmax_argmax(logits: np.ndarray, never_predict: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x [T] argmax, p [T] its probability, probs [T, V]) in float64; lowest id on ties."""
    z = np.asarray(logits, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    choosable = z.copy()
    if len(never_predict):
        choosable[:, list(never_predict)] = -np.inf
    x = choosable.argmax(axis=-1).astype(np.int64)
    return x, probs[np.arange(len(x)), x], probs


# ------------------------------------------------------------------------------------------------ JointThreshold


@dataclass
class PassOutcome:
    block: np.ndarray  # the block's tokens after the pass
    committed: np.ndarray  # block positions whose mask took a token
    edited: np.ndarray  # block positions whose token was replaced by a different token
    post_edit_steps: int
    ended: str | None  # None (run another pass), "no_change", "budget"


def joint_threshold_pass(block: np.ndarray, logits: np.ndarray, prompt: np.ndarray, post_edit_steps: int, *,
                         mask_id: int, threshold: float, edit_threshold: float, max_post_edit_steps: int,
                         penalty_lambda: float = 0.0, never_predict: Sequence[int] = ()) -> PassOutcome:
    """One pass of SGLang's JointThreshold on one block: block [T] tokens, logits [T, V], prompt [T] bool."""
    block = np.asarray(block, np.int64)
    logits = np.array(logits, np.float64)
    if penalty_lambda > 0:
        logits[np.arange(1, len(block)), block[:-1]] -= penalty_lambda
    x, p, _ = _softmax_argmax(logits, never_predict)
    masked = block == mask_id
    commit = np.zeros(len(block), bool)
    if masked.any():
        confidence = np.where(masked, p, -np.inf)
        commit = confidence > threshold
        if not commit.any():
            commit[int(np.argmax(confidence))] = True  # SGLang: torch.topk(confidence, k=1)
    else:
        post_edit_steps += 1
        if post_edit_steps > max_post_edit_steps:
            return PassOutcome(block.copy(), np.zeros(0, np.int64), np.zeros(0, np.int64), post_edit_steps, "budget")
    edit = (p > edit_threshold) & (block != x) & ~masked & ~np.asarray(prompt, bool)
    if not (commit | edit).any():
        return PassOutcome(block.copy(), np.zeros(0, np.int64), np.zeros(0, np.int64), post_edit_steps, "no_change")
    out = block.copy()
    out[commit | edit] = x[commit | edit]
    return PassOutcome(out, np.flatnonzero(commit), np.flatnonzero(edit), post_edit_steps, None)


@dataclass
class EditResult:
    tokens: np.ndarray  # the canvas when the loop ended
    nfe: int  # passes (see the module docstring)
    edits: int  # tokens replaced by a different token, summed over passes (mask commits are not edits)
    commits: int  # masks that took a token, summed over passes
    passes_per_block: list[int] = field(default_factory=list)
    capped: int = 0  # blocks that reached SGLang's max_steps before ending
    stopped: bool = False  # a stop id ended the loop
    log: list[dict] = field(default_factory=list)  # per pass: block, pass, committed / edited (absolute), ended
    extra: dict = field(default_factory=dict)  # the indel variant's counts (deletes, splits, cleanups)


def _blocks(prompt: np.ndarray, *, mask_id: int, gen_length: int, block_length: int, layout: str
            ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(canvas, [(lo, hi, logits_end)] of the blocks to decode); logits_fn gets x[:logits_end]."""
    prompt = np.asarray(prompt, np.int64)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt must be non-empty 1-D token ids, got shape {prompt.shape}")
    if mask_id in prompt:
        raise ValueError("the prompt holds the mask id: a block's masks at entry are what it decodes")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; choose from {', '.join(LAYOUTS)}")
    if gen_length < 1 or block_length < 1:
        raise ValueError(f"gen_length={gen_length}, block_length={block_length}: both must be >= 1")
    P, T = prompt.size, block_length
    if layout == "block_diffusion":
        num_blocks = -(-(P + gen_length) // T)
        x = np.full(num_blocks * T, mask_id, np.int64)
        x[:P] = prompt
        return x, [(b * T, (b + 1) * T, (b + 1) * T) for b in range(P // T, num_blocks)]
    if gen_length % T:
        raise ValueError(f"gen_length={gen_length} is not a multiple of block_length={T} (bidirectional layout)")
    x = np.concatenate([prompt, np.full(gen_length, mask_id, np.int64)])
    return x, [(P + b * T, P + (b + 1) * T, P + gen_length) for b in range(gen_length // T)]


def _block_logits(logits_fn: LogitsFn, x: np.ndarray, lo: int, hi: int, end: int) -> np.ndarray:
    logits = np.asarray(logits_fn(x[None, :end].copy()))
    if logits.ndim != 3 or logits.shape[:2] != (1, end):
        raise ValueError(f"logits_fn returned shape {logits.shape}, expected (1, {end}, V)")
    return logits[0, lo:hi]


def joint_threshold_generate(logits_fn: LogitsFn, prompt: Sequence[int] | np.ndarray, *, mask_id: int,
                             gen_length: int, block_length: int, layout: str = "block_diffusion",
                             threshold: float = 0.5, edit_threshold: float = 0.0, max_post_edit_steps: int = 16,
                             penalty_lambda: float = 0.0, never_predict: Sequence[int] = (),
                             stop_ids: Sequence[int] | None = None) -> EditResult:
    """SGLang's JointThreshold over every block of one prompt (see the module docstring): tokens, NFE, edits."""
    if int(max_post_edit_steps) != max_post_edit_steps or max_post_edit_steps < 0:
        raise ValueError(f"max_post_edit_steps={max_post_edit_steps!r} must be a non-negative integer")
    P = len(prompt)
    x, blocks = _blocks(np.asarray(prompt), mask_id=mask_id, gen_length=gen_length, block_length=block_length,
                        layout=layout)
    cap = block_length + max_post_edit_steps + 1  # SGLang's max_steps (step calls per block)
    stops = np.asarray(sorted(set(stop_ids or ())), np.int64)
    result = EditResult(tokens=x, nfe=0, edits=0, commits=0)
    for b, (lo, hi, end) in enumerate(blocks):
        prompt_in_block = np.arange(lo, hi) < P
        post_edit_steps, passes, ended = 0, 0, None
        while passes < cap:
            out = joint_threshold_pass(x[lo:hi], _block_logits(logits_fn, x, lo, hi, end), prompt_in_block,
                                       post_edit_steps, mask_id=mask_id, threshold=threshold,
                                       edit_threshold=edit_threshold, max_post_edit_steps=max_post_edit_steps,
                                       penalty_lambda=penalty_lambda, never_predict=never_predict)
            passes += 1
            x[lo:hi] = out.block
            post_edit_steps, ended = out.post_edit_steps, out.ended
            result.commits += out.committed.size
            result.edits += out.edited.size
            result.log.append({"block": b, "pass": passes - 1, "committed": (lo + out.committed).tolist(),
                               "edited": (lo + out.edited).tolist(), "ended": ended})
            if ended:
                break
        result.capped += ended is None
        result.nfe += passes
        result.passes_per_block.append(passes)
        if stops.size and np.isin(x[P:hi], stops).any():
            result.stopped = True
            break
    return result


# ------------------------------------------------------------------------------------------------ InDel


@dataclass
class IndelState:
    """SGLang @0fbe7e46 `init_step_state` for one block (prompt: the block's leading non-mask positions)."""
    prompt_len: int
    is_orig_mask: np.ndarray  # [T] bool: the position's token descends from a mask present at block entry
    post_edit_steps: int = 0
    num_update_steps: int = 0
    finished: bool = False
    seen_input_keys: set = field(default_factory=set)
    sampled_history: dict = field(default_factory=dict)  # block position -> set of tokens written there

    @classmethod
    def enter(cls, block: np.ndarray, prompt_len: int, mask_id: int) -> "IndelState":
        orig = np.asarray(block) == mask_id
        orig[:prompt_len] = False
        return cls(prompt_len=prompt_len, is_orig_mask=orig)


@dataclass
class IndelPass:
    block: np.ndarray
    written: int  # positions written (commits, edits, deletes, splits, rewrites of the same token)
    commits: int  # masks written with a token that is not DELETE / SPLIT / MASK
    edits: int  # non-mask positions written with a different ordinary token (none of MASK, DELETE, SPLIT)
    deletes: int  # DELETE written (a position removed)
    splits: int  # SPLIT written (a mask inserted before the position's old token)
    cleanup: bool  # this was the final cleanup pass
    antiloop: bool  # the anti-loop rule changed a prediction this pass
    ended: bool  # the block is finished after this pass


def _apply_edit_operations(block_tokens: list[int], old: list[int], is_orig: list[bool], prompt_len: int, T: int,
                           *, mask_id: int, delete_id: int, split_id: int) -> tuple[list[int], list[bool]]:
    """SGLang's `_apply_edit_operations`: the prompt copied from the old block; after it DELETE drops its
    position, SPLIT becomes [new MASK, the position's OLD token] (the old token keeps its flag, the mask is
    new), anything else stays; then truncated, or padded with new masks, to T."""
    tokens, flags = list(old[:prompt_len]), list(is_orig[:prompt_len])
    for i in range(prompt_len, T):
        if block_tokens[i] == delete_id:
            continue
        if block_tokens[i] == split_id:
            tokens += [mask_id, old[i]]
            flags += [False, is_orig[i]]
        else:
            tokens.append(block_tokens[i])
            flags.append(is_orig[i])
    tokens, flags = tokens[:T], flags[:T]
    pad = T - len(tokens)
    return tokens + [mask_id] * pad, flags + [False] * pad


def indel_pass(state: IndelState, block: np.ndarray, logits: np.ndarray, *, mask_id: int, delete_id: int,
               split_id: int, threshold: float, edit_threshold: float, max_post_edit_steps: int) -> IndelPass:
    """One pass of SGLang @0fbe7e46 `JointThresholdInDel.step` on one block (updates `state` in place)."""
    T = len(block)
    block = np.asarray(block, np.int64)
    z = np.asarray(logits, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    x = z.argmax(axis=-1).astype(np.int64)
    p = probs[np.arange(T), x]
    prompt = np.arange(T) < state.prompt_len
    mask_index = ~prompt & (block == mask_id)
    orig_mask_index = state.is_orig_mask & mask_index
    n_orig, n_total = int(orig_mask_index.sum()), int(mask_index.sum())
    n_introduced = n_total - n_orig

    state.num_update_steps += 1
    if n_orig == 0:  # the budget is cumulative: a mask that reappears later does not reset it
        state.post_edit_steps += 1
    limit = max_post_edit_steps > 0 and state.post_edit_steps >= max_post_edit_steps
    cleanup = limit or (max_post_edit_steps == 0 and n_orig == 0) or state.num_update_steps > T + max_post_edit_steps

    if not cleanup:  # an original mask whose argmax is MASK takes its best non-MASK token instead
        fallback = np.flatnonzero(orig_mask_index & (x == mask_id))
        for j in fallback:
            zj = z[j].copy()
            zj[mask_id] = -np.inf
            x[j] = int(zj.argmax())
            p[j] = probs[j, x[j]]

    m2t = np.zeros(T, bool)
    if n_total > 0:
        confidence = np.where(mask_index, p, -np.inf)
        if cleanup:
            m2t = mask_index.copy()
        elif n_orig > 0:
            required = 1 + n_introduced  # at least one original mask must be among them
            high = (confidence > threshold) & mask_index
            if high.sum() >= required:
                m2t = high
            else:
                m2t[_top(confidence, min(required, n_total))] = True
        else:
            m2t = mask_index.copy()
    if max_post_edit_steps == 0 and n_orig > 0 and not (orig_mask_index & ~m2t).any():
        cleanup = True  # with no post-edit rounds, the pass that takes the last original masks also cleans up
        m2t = mask_index.copy()

    t2t = (p > edit_threshold) & (block != x) & ~mask_index & ~prompt
    transfer = m2t | t2t
    write = np.flatnonzero(transfer)
    if write.size == 0:
        state.finished = True
        return IndelPass(block.copy(), 0, 0, 0, 0, 0, cleanup, False, True)

    if cleanup:  # the cleanup pass writes no MASK, DELETE or SPLIT
        special = (mask_id, delete_id, split_id)
        for j in write:
            if x[j] in special:
                zj = z[j].copy()
                zj[list(special)] = -np.inf
                x[j] = int(zj.argmax())

    key = tuple(block.tolist())
    antiloop = False
    if key in state.seen_input_keys and not cleanup:  # a block state seen before: change one prediction
        changing = np.flatnonzero(transfer & (x != block))
        if changing.size:
            j = int(changing[np.argmin(p[changing])])  # the least confident change (first on ties)
            zj = z[j].copy()
            for tok in state.sampled_history.get(j, ()):
                zj[tok] = -np.inf
            if orig_mask_index[j]:
                zj[mask_id] = -np.inf
            new = int(zj.argmax())
            antiloop = new != x[j]
            x[j] = new
    state.seen_input_keys.add(key)

    old = block.tolist()
    tokens = list(old)
    commits = edits = deletes = splits = 0
    changed = False
    for j in write.tolist():
        tok = int(x[j])
        state.sampled_history.setdefault(j, set()).add(tok)
        tokens[j] = tok
        changed |= tok != old[j]
        if tok == delete_id:
            deletes += 1
        elif tok == split_id:
            splits += 1
        elif mask_index[j] and tok != mask_id:
            commits += 1
        elif not mask_index[j] and tok != old[j] and tok != mask_id:  # the mask written back is no edit
            edits += 1
    if deletes or splits:
        tokens, flags = _apply_edit_operations(tokens, old, state.is_orig_mask.tolist(), state.prompt_len, T,
                                               mask_id=mask_id, delete_id=delete_id, split_id=split_id)
        state.is_orig_mask = np.asarray(flags, bool)
    if cleanup:
        state.finished = True
    return IndelPass(np.asarray(tokens, np.int64), int(write.size), commits, edits, deletes, splits, cleanup,
                     antiloop, cleanup)


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """The k largest values' positions (stable: lowest position first among equals; SGLang's torch.topk leaves
    tie order unspecified)."""
    return np.argsort(-np.asarray(values, np.float64), kind="stable")[:k]


def joint_threshold_indel_generate(logits_fn: LogitsFn, prompt: Sequence[int] | np.ndarray, *, mask_id: int,
                                   delete_id: int, split_id: int, gen_length: int, block_length: int,
                                   layout: str = "block_diffusion", threshold: float = 0.5,
                                   edit_threshold: float = 0.0, max_post_edit_steps: int = 16,
                                   stop_ids: Sequence[int] | None = None) -> EditResult:
    """SGLang's JointThresholdInDel (@0fbe7e46) over every block of one prompt: the same layouts and NFE as
    `joint_threshold_generate`, with `extra` counting deletes, splits and cleanup passes.

    One pass (`indel_pass`), with x / p the argmax over the FULL vocabulary (MASK, DELETE and SPLIT included)
    and "original" masks those present at block entry (and their descendants through SPLIT):
      1. a pass where no original mask is left consumes the post-edit budget (cumulative); the pass is the final
         CLEANUP when the budget is reached (post_edit_steps >= max_post_edit_steps > 0), or when
         max_post_edit_steps == 0 and no original mask is left, or after block_length + max_post_edit_steps
         passes;
      2. not cleanup: at an original mask whose argmax is MASK, the best non-MASK token (and its p) instead;
      3. M2T: cleanup: every mask; original masks left: quota 1 + (introduced masks): the masks with
         p > threshold if at least that many, else the quota's most confident; only introduced masks left: all
         of them. With max_post_edit_steps == 0 the pass that takes the last original masks becomes the cleanup;
      4. T2T: every non-mask, non-prompt position whose argmax differs, with p > edit_threshold;
      5. nothing to write: the block ends (this pass counts). Cleanup: MASK / DELETE / SPLIT writes become the
         best other token. ANTI-LOOP (not cleanup): if this block state was seen at the start of an earlier
         pass, the least confident changing position takes its best token not yet written there (not MASK at
         an original mask);
      6. writes: a DELETE or SPLIT among them rebuilds the block (`_apply_edit_operations`: truncated / padded
         with new masks to block_length); cleanup ends the block.
    Bound: block_length + max_post_edit_steps + 1 passes per block (step 1 forces the cleanup).

    Not pinned down by what was read (the report was not at hand), each followed as the code reads:
      * which stored version is current: @0fbe7e46 is transcribed; @7c7e7941 differs (no cleanup pass and no
        MASK fallback; budget `>`, so one more post-edit pass; DELETE/SPLIT applied over the whole block, prompt
        included; anti-loop history recorded after the write).
      * @0fbe7e46's docstring says its cumulative budget "intentionally differs from the released reference
        decoder" (which resets it when an original mask reappears): that decoder was not found.
      * the anti-loop key is the block's tokens at the START of the pass; `sampled_history` is keyed by block
        position and is not shifted when DELETE / SPLIT move tokens (as the code).
      * SGLang's DELETE / SPLIT ids come from its DllmConfig (`delete_token_id`, `split_token_id`), i.e. from
        the checkpoint; no public LLaDA2.2 config was read, so they are arguments here.
      * the torch.topk tie order of the quota is replaced by lowest position first.
      * SGLang reads the prompt from `forward_batch.dllm_prompt_mask` (else the leading non-mask run); here the
        prompt tail is known exactly (positions < P).
    """
    if int(max_post_edit_steps) != max_post_edit_steps or max_post_edit_steps < 0:
        raise ValueError(f"max_post_edit_steps={max_post_edit_steps!r} must be a non-negative integer")
    if len({mask_id, delete_id, split_id}) != 3:
        raise ValueError("mask_id, delete_id and split_id must be three different ids")
    P = len(prompt)
    x, blocks = _blocks(np.asarray(prompt), mask_id=mask_id, gen_length=gen_length, block_length=block_length,
                        layout=layout)
    cap = block_length + max_post_edit_steps + 2  # SGLang's max_steps; step 1's forced cleanup ends sooner
    stops = np.asarray(sorted(set(stop_ids or ())), np.int64)
    result = EditResult(tokens=x, nfe=0, edits=0, commits=0, extra={"deletes": 0, "splits": 0, "cleanups": 0,
                                                                      "antiloop": 0})
    for b, (lo, hi, end) in enumerate(blocks):
        state = IndelState.enter(x[lo:hi], int(np.sum(np.arange(lo, hi) < P)), mask_id)
        passes = 0
        while not state.finished and passes < cap:
            out = indel_pass(state, x[lo:hi], _block_logits(logits_fn, x, lo, hi, end), mask_id=mask_id,
                             delete_id=delete_id, split_id=split_id, threshold=threshold,
                             edit_threshold=edit_threshold, max_post_edit_steps=max_post_edit_steps)
            passes += 1
            x[lo:hi] = out.block
            result.commits += out.commits
            result.edits += out.edits
            for k in ("deletes", "splits"):
                result.extra[k] += getattr(out, k)
            result.extra["cleanups"] += out.cleanup
            result.extra["antiloop"] += out.antiloop
            result.log.append({"block": b, "pass": passes - 1, "tokens": out.block.tolist(),
                               "cleanup": out.cleanup, "ended": out.ended})
        result.capped += not state.finished
        result.nfe += passes
        result.passes_per_block.append(passes)
        if stops.size and np.isin(x[P:hi], stops).any():
            result.stopped = True
            break
    return result
