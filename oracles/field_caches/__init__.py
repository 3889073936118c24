"""Eager transcriptions of the field's approximate caches for bidirectional diffusion LLMs (LLaDA), one row at a time:
the references the compiled cache policies (`ll.cache("dllm_cache" | "dkv" | "d2cache" | "vicinity", ...)`) are
tested against. Torch only; nothing here imports localleap_jax.

    net = EagerLLaDA(hf_config, tensors)                       # LLaDA from its HF tensor names (network.py)
    kw = dict(gen_length=32, block_length=8, mask_id=m, rule=Threshold(0.9), exclude_ids=(m,))
    dllm_cache(net, prompt, **kw, prompt_interval=50, gen_interval=7, transfer_ratio=0.25)
    dkv(net, prompt, **kw, reload_every=8)
    d2cache(net, prompt, **kw, rollout_p=0.1, current_k=32, sigma=10.0, inflate_w=4)
    vicinity(net, prompt, **kw, prefix_look=16, after_look=16, warmup=4, refresh_every=None)
    no_cache(net, prompt, **kw)                                # every pass full: what each degenerates to
    per_row(dkv, net, prompts [B, P], attention_mask [B, P], **kw, reload_every=8)   # a left-padded batch
-> CacheResult(x [P+G], nfe, busy_nfe, log: [PassLog(kind, block, step, queries, commits, busy, detail)]) for one
row (prompt [P], unpadded: positions are 0..P+G-1); per_row -> BatchResult(x [B, P+G], nfe [B], busy_nfe [B], logs).
Rules (common.py): Threshold(0.9) (Fast-dLLM's get_transfer_index: top-1 plus every candidate >= threshold, float64),
LowConfidence(steps) (LLaDA's schedule; LowConfidence.dllm_cache(steps) is dLLM-Cache's own generate's precision),
DInferThreshold(0.9) (dInfer's ThresholdParallelDecoder). `exclude_ids`: ids never predicted (the project's loop
never predicts the mask id); default none, as the authors. Greedy only.

NFE: `nfe` counts every forward pass as the authors do (partial passes and no-op passes included); `busy_nfe`
leaves out the passes whose block held no mask at their input (only LLaDA's fixed-step loop with steps > masks,
and vicinity's window pass after a refresh that filled the block, run such passes): it is what oracles/fast_dllm.py
calls `row_nfe` (passes in which the row had a candidate). A block that runs far more passes than it can need
raises (`common.stuck`): with exclude_ids=() a model whose argmax is the mask id makes the authors' loops spin.

Every loop below was run against the authors' own code on tiny random 3-layer LLaDA models (fp32, B=1, gen_length
32, blocks 8 and 16, the reference's settings, 2 models x 3 prompts) and gave the same tokens and NFE in every case:
dLLM-Cache 60/60 (their hooks under their generate and under Fast-dLLM's threshold loop), dKV-Cache 48/48 (their
generate, and its header/selection patched to the threshold rule as the check does), d2Cache 48/48 (their
vanilla_generate + d2Cache + their LLaDA model, eager), vicinity 96/96 (dInfer's VicinityCacheDiffusionLLM and
decoders over transformers' Llama; dInfer's own LLaDA model needs vLLM). The scripts live outside the repository.

dllm_cache — dLLM-Cache (maomaocun/dLLM-cache @ 17235bf; dllm_cache/hooks/cache_hook_LLaDA.py, cache/Cache.py,
utils/generate_function.py)
  keeps   per layer: keys, values, the attention sublayer's output (after attn_out) and the FFN sublayer's output
          (after ff_out), each split into the prompt part and the response part (the whole generated region). The
          residual stream is never kept: each layer adds the (fresh or kept) outputs to its current input.
  refresh pass n = 1, 2, ... counted over the whole generation (Cache.py:79-80: the largest per-layer counter; no
          reset at block changes): the prompt part in layers >= 1 when (n-1) % prompt_interval == 0, the response
          part when (n-1) % gen_interval == 0. Layer 0 refreshes both on every pass (cache_hook_LLaDA.py:156-157).
  a pass  a refreshed part: its queries/keys/values and both outputs fresh; its queries attend over the fresh
          keys/values of refreshed parts and the kept ones of the other part. Response not refreshed and
          0 < transfer_ratio <= 1 (:160): the values of ALL response positions are recomputed and kept; the
          int(G * ratio) positions whose fresh value has the lowest cosine similarity with the kept one (the
          previous pass's) get fresh queries, keys (kept), attention output (over all keys, the fresh values) and FFN
          output; the others reuse their kept key and outputs. Ratio 0: the response comes wholly from the cache.
          With only the prompt refreshed, its queries and the picked response queries share one attention call.
  quirks  no attention mask (padding attended in a batch; here a row runs alone). Their generate is LLaDA's
          schedule with `for i in range(steps_per_block)` (passes that commit nothing still run and count), fp32
          softmax, argmax taken over exp(logits) (generate_function.py:69, 118-123).
  NFE     every pass.

dkv — dKV-Cache-Decode (horseee/dKV-Cache @ 49a76fc; generation_utils/llada_dkv_cache_decode.py,
models/modeling_llada_dkv_cache_decode.py)
  keeps   the keys and values (before RoPE) of positions decoded at a pass's input; dropped when a block starts
          (llada_dkv_cache_decode.py:86).
  refresh the block's pass i: i = 0 full, nothing kept; i = 1 full, keeps the positions decoded at its input
          (modeling :1023); i > 1 and i % reload_every == 0 the same ("reload"); other i > 1 cached (:103, :116).
  a pass  a cached pass i runs, through every layer, the positions NOT decoded at pass i-1's input (:107): every
          mask of the canvas (future blocks too) and what pass i-1 committed; all other keys/values come from the
          cache (:1007); afterwards the cache holds the positions decoded at pass i's input, the just-recomputed
          commits with their fresh keys/values (:1063). Absolute RoPE positions throughout.
  quirks  delayed caching (a token committed by pass j is recomputed with its own embedding in pass j+1 and read
          from the cache from j+2 on); their loop is `for i in range(steps)` per block (:92), float64 softmax; the
          check's threshold variant keeps i and ends the block when it has no mask.
  NFE     every pass.

vicinity — dInfer's vicinity refresh (inclusionAI/dInfer @ fce4e32; python/dinfer/decoding/generate_uniform.py,
utils.py, parallel_strategy.py)
  keeps   every position's keys/values from the last refresh pass.
  refresh iter_no counts every pass of the generation (reset per generation, generate_uniform.py:480). While
          iter_no < warmup: full passes without a cache (:622). Then an iteration is [refresh] + window. A refresh
          pass (whole canvas; it decodes the block and replaces the cache) runs when there is no cache, or when the
          manager asks AND block_id > 0 (:629); the manager records the block every time it is asked
          (utils.py:397-422) and is not asked when there is no cache (the `or` short-circuits): the first cache
          built in a block after the first is followed by a second refresh at the next iteration; in block 0 a
          periodic refresh (refresh_every) never happens.
  a pass  the window [max(0, start - prefix_look), min(L, end + after_look)) runs fresh over the cached
          keys/values elsewhere (its own are not written back: utils.py:364 slice_scatter) and decodes the block
          (:637); it runs even after a refresh that filled the block.
  quirks  maximum_unroll (default 4, :98) lets iterations run on a full block: transcribed with maximum_unroll=1
          (the check's); early_stop off; blocks from the prompt's end (start_block_align=False). Their
          ThresholdParallelDecoder (DInferThreshold) commits near-ties within 1e-5 of the top and never a
          prediction of the mask id (parallel_strategy.py:279, 283); the check decodes with get_transfer_index
          (Threshold). The decode count in the block is the rule's step (for LowConfidence: schedule[step], 0 after).
  NFE     every pass (warmup, refresh, window); busy_nfe leaves out the window passes on a full block.
  note    writing the window's keys/values back would change nothing: every block starts with a refresh (block 0:
          the first cache; later blocks: the block change), a block's windows all span the same positions, and
          those are recomputed in every window pass (a variant that writes them back passes every test here and
          gave the same tokens and NFE in 64 of 64 runs: 2 models, 4 prompts, blocks 8 and 16, the check's settings).
  looks 0 = Fast-dLLM's dual cache (same tokens; busy_nfe = Fast-dLLM's NFE).

d2cache — d2Cache (Kamichanw/d2Cache @ 72feb60; src/cache/d2cache.py, src/utils/common.py,
src/generation/vanilla.py, src/generation/utils.py)
  keeps   every position's keys/values (before RoPE) per layer from the first pass; afterwards a position's row is
          rewritten only in a pass that runs it as a query. No refresh, nothing at block changes.
  a pass  the first pass runs everything; each later pass runs only the positions picked after the previous pass
          (their hidden states only; the others get all-zero logits: confidence 1/vocab, and they stay candidates
          because vanilla.py:81 narrows a copy). The picks (`pick_queries`):
          1. up to current_k remaining masks by score = first-pass confidence (d2cache.py:187; never updated:
             :202 assigns into a copy) x certainty density (Gaussian kernel by FFT over the generated region, left
             of it counted decoded, right of it decoded iff the region's last position is), the block's masks
             first (their score + the max score), among region positions from the block's first mask to a search
             end (see below);
          2. this pass's commits; 3. the attention-rollout nucleus (head-averaged probabilities of the queries,
             identity rows elsewhere, + identity, rows normalised, multiplied from layer 0 up; importance = column
             sums; shares over the unpicked positions' total, kept while the cumulative share <= rollout_p, at
             least one); 4. inflation (an unpicked position whose distances to the previous and next picks sum to
             <= inflate_w).
  quirks  (not in the reference, decides tokens) the block mask the cache sees is narrowed in place every pass to
          the block's positions still masked at the pass's input (utils.py:202, `eligible_mask &= ...`, reached
          from vanilla.py:44-46). So on_step_end's `block_size` (d2cache.py:204) is the number of the block's masks
          at the pass's input, not block_length: the search end is (e // u + 1) * u - 1 with u that count and e the
          region index where the current_k-th remaining mask lies (:207-212); the window starts at the block's
          first mask at the input (:214); the +max bias goes to the block's masks at the input (:223). With u =
          block_length (as ../shared/reference/field-caches.md says) 17 of 48 authors' cases gave other tokens.
          Batched, the authors top every row up to the batch's largest pick count: not done (a row alone).
  NFE     every pass.

Where ../shared/reference/field-caches.md was wrong or incomplete:
  * d2cache: the search range's grid unit and start, and the bias, are defined by the block's masks at the pass's
    input, not the block (above; d2cache.py:204-223 with utils.py:202).
  * dllm_cache: a ratio whose int(G * ratio) is 0 still recomputes every response value each non-refresh pass
    (cache_hook_LLaDA.py:160 tests only 0 < ratio <= 1): no effect on tokens, stated for completeness.
"""

from oracles.field_caches.common import (BatchResult, CacheResult, CommitRule, DInferThreshold, LowConfidence,
                                         PassLog, Threshold, no_cache, per_row)
from oracles.field_caches.d2cache_loop import d2cache
from oracles.field_caches.dkv_loop import dkv
from oracles.field_caches.dllm_cache_loop import dllm_cache
from oracles.field_caches.network import EagerLLaDA
from oracles.field_caches.vicinity_loop import vicinity

LOOPS = {"none": no_cache, "dllm_cache": dllm_cache, "dkv": dkv, "d2cache": d2cache, "vicinity": vicinity}

__all__ = ["BatchResult", "CacheResult", "CommitRule", "DInferThreshold", "EagerLLaDA", "LOOPS", "LowConfidence",
           "PassLog", "Threshold", "d2cache", "dkv", "dllm_cache", "no_cache", "per_row", "vicinity"]
