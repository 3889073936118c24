"""An eager PyTorch oracle for SDAR block-diffusion models, for tests only: not the library's path.

SDAR (JetAstra/SDAR; TraDo from Gen-Verse uses the same `model_type: "sdar"` checkpoints) is Qwen3
continued-pretrained as a block-diffusion LM. Its network is a Qwen3 decoder unchanged (per-head RMSNorm
q_norm/k_norm before RoPE, GQA, explicit head_dim, no q/k/v bias, SwiGLU); only the attention pattern and
the decoding loop differ. So this module runs the checkpoint as transformers' own `Qwen3ForCausalLM`
(eager attention, fp32) with a block-causal 4D mask, and transcribes SDAR's `generate.py`
(`block_diffusion_generate`) as a plain Python loop over NumPy. It shares no code with `model.py`,
`decode/` or the JAX rules on purpose; it reads `reference_rules` only to adapt the eager rules.

What was read (public code, transcribed here, not copied):
  * JetAstra/SDAR `generate.py` (both stored versions): the grid, prefill, the `denoising_steps + 1` loop
    with its store pass, `get_num_transfer_tokens`, the three remasking strategies, the stopping check.
  * JetAstra/SDAR `training/model/SDAR-4B-Chat/modeling_sdar.py`: Qwen3 layers; at inference a
    boolean block mask (`torch.all(mask)` -> non-causal flash attention, else SDPA with the mask), a KV
    cache written only when `store_kv=True`, explicit `position_ids`, no logits shift.
  * JetLM/SDAR-4B-Chat `config.json`: Qwen3 fields (head_dim 128, rope_theta 1e6, tie_word_embeddings
    false, rope_scaling null, use_sliding_window false); some derived checkpoints add `block_size` and
    `mask_token_id` keys, the JetLM 4B main config has neither (SDARConfig takes them through **kwargs).

Greedy decoding: SDAR's sampler (temperature / top-k / top-p, then `torch.multinomial`) is replaced by
argmax, and its confidence `x0_p` by the temperature-1 softmax probability of the argmax (float64 here).
As in SDAR, the mask token is not excluded from the argmax.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch

# Token ids of the SDAR / TraDo Qwen3 tokenizer (added_tokens.json: "<|MASK|>": 151669; generate.py's
# first version stops on [151645, 151643] = <|im_end|>, <|endoftext|>; JetEngine / lmdeploy use 151669).
SDAR_MASK_TOKEN = "<|MASK|>"
SDAR_MASK_TOKEN_ID = 151669
SDAR_STOP_IDS = (151645, 151643)
SDAR_DEFAULT_BLOCK_SIZE = 4  # the JetLM *-Chat default; *-b8/-b16/-b32/-b64 checkpoints are retrained

STRATEGIES = ("low_confidence_static", "low_confidence_dynamic")

LogitsFn = Callable[[np.ndarray], np.ndarray]  # ids [1, n] -> block-causal logits [1, n, V]
CommitRule = Callable[[np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]  # (conf, pred, cand, step) -> bool [T]


# ------------------------------------------------------------------------------------------------
# The network


def _qwen3_config(hf_config: Mapping):
    """transformers' Qwen3Config for an SDAR config.json dict; refuses what a Qwen3 block would silently get wrong."""
    from transformers import Qwen3Config

    cfg = dict(hf_config)
    model_type = cfg.get("model_type", "sdar")
    if model_type != "sdar":  # sdar_moe (SDAR-30B-A3B) has MoE blocks, not Qwen3 dense ones
        raise ValueError(f"model_type={model_type!r}: this oracle runs dense SDAR ('sdar') only")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r}: SDAR's MLP is SwiGLU (silu)")
    if cfg.get("attention_bias", False):
        raise ValueError("attention_bias=true: SDAR checkpoints have no q/k/v/o biases and this oracle loads none")
    if cfg.get("rope_scaling") is not None:
        raise ValueError(f"rope_scaling={cfg['rope_scaling']!r}: only plain RoPE (rope_scaling null) is supported")
    if cfg.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true: SDAR's inference attention ignores sliding windows; refused")
    if cfg.get("head_dim") is None:
        # SDARConfig would default to 128 and SDARAttention to hidden/heads: ambiguous, so ask for it.
        raise ValueError("config has no head_dim: give it explicitly (SDAR configs carry head_dim)")
    heads = cfg["num_attention_heads"]
    return Qwen3Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg["head_dim"],
        hidden_act="silu",
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        # SDARConfig's defaults where the json is silent: untied, rope_theta 10000.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))},
        attention_bias=False,
        use_sliding_window=False,
        attention_dropout=0.0,
        use_cache=False,
        # eager: the additive 4D mask below is added to the scores as written, nothing is inferred from it.
        attn_implementation="eager",
    )


def sdar_torch_model(hf_config: Mapping, state_dict: Mapping[str, np.ndarray]) -> torch.nn.Module:
    """transformers' Qwen3ForCausalLM (fp32, eval, eager attention) holding an SDAR checkpoint's tensors.

    `state_dict` uses the checkpoint's own (HF Qwen3) names. A tied checkpoint (tie_word_embeddings true)
    has no lm_head.weight: the head is the embedding; an untied one must have it.
    """
    from transformers import Qwen3ForCausalLM

    cfg = _qwen3_config(hf_config)
    tied = cfg.tie_word_embeddings
    tensors = {k: torch.from_numpy(np.asarray(v, np.float32).copy()) for k, v in state_dict.items()}
    if tied and "lm_head.weight" in tensors:
        if not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ValueError("tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight")
        del tensors["lm_head.weight"]
    if not tied and "lm_head.weight" not in tensors:
        raise ValueError("tie_word_embeddings=false but the checkpoint has no lm_head.weight")

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    result = model.load_state_dict(tensors, strict=False)
    allowed_missing = {"lm_head.weight"} if tied else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        missing = sorted(set(result.missing_keys) - allowed_missing)
        raise ValueError(f"checkpoint does not match the SDAR/Qwen3 layout: missing {missing}, "
                         f"unexpected {sorted(result.unexpected_keys)}")
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        model.lm_head.weight = model.model.embed_tokens.weight  # never silently keep a random head
    return model.eval()


def block_causal_mask(mask: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(allowed [B, L, L] bool, positions [B, L] int64) of SDAR's attention for a left-padded batch.

    Each row's grid starts at its first real token: p = index - first_real_index. A query at p sees a key at
    q iff q // block_size <= p // block_size and the key is real (within a block: bidirectional). Padding
    queries see only themselves (their outputs are meaningless; this just keeps their softmax finite).
    """
    mask = np.asarray(mask, bool)
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, L], got shape {mask.shape}")
    B, L = mask.shape
    if not mask.any(axis=1).all():
        raise ValueError("every row needs at least one real token")
    first = mask.argmax(axis=1)  # index of each row's first real token
    pos = np.arange(L)[None, :] - first[:, None]  # negative on left padding
    blk = np.floor_divide(pos, block_size)
    allowed = (blk[:, None, :] <= blk[:, :, None]) & mask[:, None, :]
    pad_q = ~mask
    allowed[:, np.arange(L), np.arange(L)] |= pad_q
    return allowed, np.maximum(pos, 0).astype(np.int64)


@torch.no_grad()
def block_causal_logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, block_size: int) -> np.ndarray:
    """Logits [B, L, V] float32 under SDAR's block-causal attention (no shift: position i predicts token i).

    transformers 5.x returns a 4D attention_mask unchanged (masking_utils: "already 4D ... returned as-is"), and
    eager attention adds it to the scores, so the mask is passed additively (0 / float32 min), with explicit
    position_ids on each row's own grid.
    """
    ids = np.asarray(ids, np.int64)
    allowed, pos = block_causal_mask(mask, block_size)
    additive = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]  # [B, 1, L, L]
    out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(additive),
                position_ids=torch.from_numpy(pos), use_cache=False)
    return out.logits.float().numpy()


def sdar_logits_fn(model: torch.nn.Module, block_size: int) -> LogitsFn:
    """The `logits_fn` for `block_diffusion_generate`: block-causal logits of an unpadded prefix, positions from 0."""
    return lambda ids: block_causal_logits(model, ids, np.ones(np.shape(ids), bool), block_size)


# ------------------------------------------------------------------------------------------------
# The decoding loop


def get_num_transfer_tokens(block_length: int, steps: int) -> np.ndarray:
    """SDAR's per-step quota inside one block: block_length // steps each, the remainder on the first steps."""
    base, remainder = divmod(block_length, steps)
    quota = np.full(steps, base, np.int64)
    quota[:remainder] += 1
    return quota


def _greedy(logits: np.ndarray, never_predict: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(argmax id, its temperature-1 softmax probability) per position, in float64; lowest id on ties.
    Ids in `never_predict` are left out of the argmax but keep their share of the softmax."""
    z = np.asarray(logits, np.float64)
    choosable = z.copy()
    if len(never_predict):
        choosable[..., np.asarray(list(never_predict))] = -np.inf
    pred = choosable.argmax(axis=-1)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    conf = np.take_along_axis(e, pred[:, None], axis=-1)[:, 0] / e.sum(axis=-1)
    return pred.astype(np.int64), conf


def _topk_mask(values: np.ndarray, k: int) -> np.ndarray:
    """SDAR's `torch.topk(confidence, k)` as a mask, by torch itself so ties (among -inf too) fall as in SDAR."""
    out = np.zeros(values.shape[0], bool)
    if k > 0:
        out[torch.topk(torch.from_numpy(values), int(k)).indices.numpy()] = True
    return out


def _sdar_transfer(strategy: str, masked: np.ndarray, conf: np.ndarray, k: int, threshold: float,
                   commit_only_masked: bool) -> np.ndarray:
    """Which block positions SDAR overwrites with their prediction this step.

    SDAR scores non-masked positions -inf and takes topk(k); when fewer than k masks are left topk also returns
    -inf positions, i.e. already-decoded tokens (or, in the first decoded block, prompt tokens), which are then
    overwritten. commit_only_masked=True takes min(k, masks left) instead (only masks ever change).
    """
    confidence = np.where(masked, conf, -np.inf)
    k_top = min(k, int(masked.sum())) if commit_only_masked else k
    if strategy == "low_confidence_static":
        return _topk_mask(confidence, k_top)
    high = confidence > threshold  # strict, as in SDAR
    if high.sum() >= k:  # SDAR compares with its own quota
        return high
    return _topk_mask(confidence, k_top)


def block_diffusion_generate(logits_fn: LogitsFn, prompt: Sequence[int] | np.ndarray, *, mask_id: int,
                             gen_length: int, block_length: int, denoising_steps: int,
                             remasking_strategy: str = "low_confidence_dynamic", confidence_threshold: float = 0.85,
                             stop_ids: Sequence[int] | None = None, commit_only_masked: bool = True,
                             rule: CommitRule | None = None, never_predict: Sequence[int] = ()
                             ) -> tuple[np.ndarray, dict[str, int]]:
    """SDAR's `block_diffusion_generate` for one prompt, greedy: (tokens [total_length], counts).

    The grid is SDAR's: num_blocks = ceil((P + G) / B), total_length = num_blocks * B, positions 0.. absolute,
    the prompt's P // B full blocks prefilled in one pass, and decoding from block P // B, so a prompt whose
    length is not a multiple of B shares its last block with the first generated tokens (its prompt positions
    are not masks but are re-run every step). Each block runs SDAR's `denoising_steps + 1` iterations: a
    denoising pass while masks remain, else one store pass (SDAR writes the finished block to its KV cache)
    and the block ends. After each block the loop stops if any stop id occurs in tokens[P:].

    `logits_fn` gets the sequence up to the current block's end and returns its block-causal logits; the
    current block's rows are used. Recomputing the prefix every step is the same computation as SDAR's exact
    KV cache (the cache holds the finished blocks' keys/values under the same block-causal mask and
    positions), so the prefill and store passes, whose outputs SDAR discards, are counted but not run.

    `rule`, if given, replaces SDAR's strategy inside each block: rule(conf [B], pred [B], candidates [B]
    bool (still-masked positions), step_in_block) -> bool [B]; only candidates commit, at least the most
    confident one (lowest position on ties) when the rule picks none, and the block runs until no mask is
    left (`denoising_steps` and the quota are not used; see `eager_rule` for the reference_rules adapter).

    `never_predict`: ids the argmax skips while they keep their softmax share (SDAR skips none; a caller
    comparing with a loop that never predicts the mask or undecodable rows passes those).

    counts: "denoise" (SDAR's denoising forward passes), "store" (store passes = blocks that finished),
    "prefill" (0 or 1), "nfe" (their sum), "blocks" (blocks entered), "stopped" (1 if a stop id ended it).
    """
    prompt = np.asarray(prompt, np.int64)
    if prompt.ndim != 1:
        raise ValueError(f"prompt must be 1-D token ids, got shape {prompt.shape}")
    for name, v in (("gen_length", gen_length), ("block_length", block_length), ("denoising_steps", denoising_steps)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if rule is None and remasking_strategy not in STRATEGIES:
        raise ValueError(f"remasking_strategy={remasking_strategy!r}; choose from {', '.join(STRATEGIES)} "
                         "('sequential' is not transcribed)")
    P, B = prompt.shape[0], block_length
    num_blocks = -(-(P + gen_length) // B)
    x = np.full(num_blocks * B, mask_id, np.int64)
    x[:P] = prompt
    prefill_blocks = P // B
    quota = get_num_transfer_tokens(B, denoising_steps)
    stops = np.asarray(sorted(set(int(s) for s in stop_ids)) if stop_ids else [], np.int64)
    counts = {"denoise": 0, "store": 0, "prefill": 1 if prefill_blocks > 0 else 0, "nfe": 0, "blocks": 0,
              "stopped": 0}

    def denoise(lo: int, hi: int, cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        counts["denoise"] += 1
        seq = np.concatenate([x[:lo], cur])[None]
        logits = np.asarray(logits_fn(seq))
        if logits.shape[:2] != (1, hi):
            raise ValueError(f"logits_fn returned shape {logits.shape}, expected (1, {hi}, V)")
        return _greedy(logits[0, lo:hi], never_predict)

    for nb in range(prefill_blocks, num_blocks):
        lo, hi = nb * B, (nb + 1) * B
        cur = x[lo:hi].copy()
        counts["blocks"] += 1
        if rule is None:
            for step in range(denoising_steps + 1):
                masked = cur == mask_id
                if not masked.any():
                    counts["store"] += 1
                    break
                if step == denoising_steps:
                    # Only reachable when the argmax was the mask id itself: SDAR would index
                    # num_transfer_tokens[denoising_steps] here and raise IndexError.
                    raise RuntimeError(f"block {nb} still has masks after {denoising_steps} steps "
                                       "(the mask id was predicted); SDAR's loop would fail here")
                pred, conf = denoise(lo, hi, cur)
                take = _sdar_transfer(remasking_strategy, masked, conf, int(quota[step]), confidence_threshold,
                                      commit_only_masked)
                cur[take] = pred[take]
        else:
            step = 0
            while True:
                masked = cur == mask_id
                if not masked.any():
                    counts["store"] += 1
                    break
                pred, conf = denoise(lo, hi, cur)
                take = np.asarray(rule(conf.copy(), pred.copy(), masked.copy(), step), bool) & masked
                if not take.any():  # the loop contract: at least the most confident candidate
                    cand = np.flatnonzero(masked)
                    take[cand[np.argmax(conf[cand])]] = True
                cur[take] = pred[take]
                if (cur == mask_id).sum() == masked.sum():
                    raise RuntimeError(f"block {nb}: a pass committed only mask ids; the block cannot finish")
                step += 1
        x[lo:hi] = cur
        if stops.size and np.isin(x[P:], stops).any():
            counts["stopped"] = 1
            break
    counts["nfe"] = counts["denoise"] + counts["store"] + counts["prefill"]
    return x, counts


# ------------------------------------------------------------------------------------------------
# The project's eager rules inside SDAR's loop


def eager_rule(rule) -> CommitRule:
    """A `reference_rules` rule object as a `rule=` callable: a fresh copy, reset when a block starts (step 0).

    Only rules that read pred/conf alone fit (localleap, threshold, factor, stable; low_confidence once
    bound); rules reading margin/entropy/whole distributions are refused. The rule's own loop contract
    (top1 when it picks nothing) applies, and block_diffusion_generate enforces it again.
    """
    from oracles import rules as reference_rules

    if rule.reads:
        raise ValueError(f"{rule.name} reads {', '.join(rule.reads)}; this adapter passes only conf and pred")
    if rule.uses_schedule and rule.gen_length is None:
        raise ValueError(f"{rule.name} follows LLaDA's schedule: bind(gen_length=..., block_length=...) it first")
    own = reference_rules.fresh(rule)

    def commit(conf: np.ndarray, pred: np.ndarray, candidates: np.ndarray, step_in_block: int) -> np.ndarray:
        if step_in_block == 0:
            own.reset()
        chosen = own.select(step_in_block, np.asarray(candidates, bool), None, pred, conf)
        out = np.zeros(len(conf), bool)
        out[list(chosen)] = True
        return out

    commit.rule = own  # type: ignore[attr-defined]
    return commit


def localleap_rule(kappa: float = 0.9, tau: float = 0.75, radius: int = 4) -> CommitRule:
    """LocalLeap (reference_rules.LocalLeap) as a `rule=` for block_diffusion_generate; radius in block positions."""
    from oracles import rules as reference_rules

    return eager_rule(reference_rules.make("localleap", kappa=kappa, tau=tau, radius=radius))
