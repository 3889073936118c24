"""An eager PyTorch oracle for Fast-dLLM v2 (NVlabs; `Efficient-Large-Model/Fast_dLLM_v2_7B`, a 1.5B), for tests
only: the network is transformers' own `Qwen2ForCausalLM` under the block-causal 4D mask with Dream's logit
shift, and the authors' `batch_sample` is a plain Python loop, batch 1, greedy.

What was read (public code, transcribed here, not copied):
  * `v2/generation_functions.py` `Fast_dLLM_QwenForCausalLM.batch_sample` (the upstream NVlabs/Fast-dLLM v2 code
    is not in the stores; its common core was read in four public forks, identical apart from each fork's
    instrumentation: NikhilSDate/Fast-dLLM@734a60d4, ghostchoir/Fast-dLLM@5fb7362c, kookhh0827/Fast-dLLM@323440bf,
    Arya333/Fast-dLLM@2b60f815), and `sample_with_top_p` at temperature 0 (softmax, then argmax of it).
  * The hub's `modeling.py` (`Fast_dLLM_QwenModel.forward`, `Fast_dLLM_QwenAttention.forward`) as carried by a
    public derivative (stored id 24715489562): block-causal `eval_mask` (block(q) >= block(kv), with the
    forward's own `block_size` argument, default 32), positions past_seen_tokens + replace_position + i, the
    block cache (`block_past_key_values`: recorded by a full block pass, then each sub-block pass writes its own
    K/V over it in place at `replace_position` and attends with no mask to the prefix cache and the whole block).
  * ../shared/reference/fast-dllm-v2.md (config keys, ids, the quirks).

## The network
Qwen2 tensors unchanged (q/k/v biases, GQA, RMSNorm, rope_theta). Attention is block-causal on each row's grid
from its first real token (positions from 0 there; padding never attended) and the logits are shifted as
Dream's: `shifted[:, i] = raw[:, i - 1]`, `shifted[:, 0] = raw[:, 0]` (position i is scored by hidden state
i - 1). The authors shift inside each forward's window (the block, or the sub-block): that differs from the
global shift only at the window's first position, which is never a mask where they run it (a free token, a
prompt token, or, in a sub-block pass, a position that is not a mask by the pass's own condition), except in
the first quirk below.

## batch_sample, one row (`batch_sample`)
  * The canvas: blocks of `block_size` on the absolute grid from position 0; `canvas="authors"`:
    max_new_tokens // bs + P // bs blocks (theirs: fewer than max_new_tokens generated when P % bs != 0);
    `canvas="sdar"`: ceil((P + max_new_tokens) / bs) blocks (SDAR's canvas, at least max_new_tokens).
    Decoding starts at block P // bs.
  * Prefill (not counted): the prompt's P // bs full blocks go to the exact prefix cache; when P % bs == 0 the
    argmax of the last prompt position's (unshifted) logits becomes the first generated token (a free token).
  * Each block: sub-blocks of `small_block_size`, in order; while the sub-block has a mask, one denoising pass:
    logits for the sub-block's positions, x = argmax, p = its softmax probability (float64 here), and the
    commit rule among the sub-block's masks: theirs is {p > threshold (strict)} plus the sub-block's most
    confident mask (first on ties). `rule=` replaces it: rule(conf [sb], pred [sb], candidates [sb] bool,
    step_in_sub_block) -> bool [sb] (oracles.sdar.eager_rule adapts any oracles/rules.py rule; it resets at step
    0, i.e. at each sub-block); at least the most confident candidate commits when a rule picks none.
      - use_block_cache=False (the exact block cache): the pass runs the whole block over the prefix cache =
        `runner.exact(x[:block end])`.
      - use_block_cache=True (their approximate sub-block cache), decided PER ROW here: a full block pass
        (`runner.full`, which also keeps every layer's K/V of the block) when this row's block cache is empty
        (the block's first pass) or the sub-block's first position is a mask; otherwise only the sub-block runs
        (`runner.sub`) against the prefix and the kept block K/V, its own K/V written over them in place (stale
        for the other sub-blocks: approximate; exact on one layer). The authors decide per BATCH (a full pass if
        the position is a mask in ANY row), so a row's tokens depend on its batch: not followed.
  * Block full: if the row committed the stop token in a denoising pass of this block, it is finished (their
    `finished_flag`; the block is completed first). Otherwise, if another block follows, one store pass
    (`runner.exact(x[:block end])`, K/V into the prefix cache) whose last position's argmax becomes the next
    block's first token (the free token; it is never a candidate). Their loop also runs it after the canvas's
    last block (one extra token beyond it): not run here, and not counted.
  * NFE (the issue's count): denoising passes + one store pass per decoded block except the row's last; the
    prefill is not counted. `result.tokens` is the canvas through the last decoded block; `stop_index` is the
    first stop token at or after P (the authors pad everything after it with the tokenizer's pad id).

## Their quirks, not reproduced (each: what they do, what this does)
  * A prompt of exactly bs tokens is never seen: their prefill runs only when the shortest prompt is LONGER than
    bs, and the first decoded block then has no cache. Here the prefill runs whenever P >= bs.
  * A middle batch row whose prompt ends on the grid loses its free token (only the first rows' get written when
    the canvas is wider), a longest prompt of k*bs + 1 tokens has its last token overwritten by a store token,
    shorter rows decode more blocks in a batch than alone (the block count follows the longest prompt): batch
    effects; this oracle decodes one row at a time, as each row alone.
  * The sub-block cache choice per batch: per row here (above).
  * Their threshold is strict (`p > threshold`), and their eval scripts pass threshold=1 for gsm8k / math /
    ifeval: then only the argmax commits (one token per pass), since no probability exceeds 1. With `>=` instead,
    every position whose confidence ROUNDS to 1.0 would commit too (fp32 / bf16 softmaxes round p > 1 - 2^-24
    to exactly 1.0, so a `>=` rule at 1.0 commits many tokens per pass). Followed: strict `>`; this oracle's
    float64 confidences equal 1.0 only when every other probability underflows.
  * Denoising passes build the block-causal mask with the forward's default block_size=32, not bd_size: the same
    for bd_size dividing 32; a wider bd_size would hide the block's second half from its first. Here bd_size.
  * The stop test reads committed tokens only: a free token equal to the stop token does not finish the row
    (followed by default; `stop_on_free_token=True` finishes it).
  * Greedy: their temperature-0 path takes the argmax of the softmax in the model dtype; here the argmax of the
    logits and a float64 softmax (the same but for rounding ties).
  * A free token is an argmax over the whole vocabulary, the mask id included (followed; `never_predict` applies
    to it too). Were it the mask id, the block's first position would be a mask that their window-local shift
    scores from its OWN hidden state; here (global shift) from the previous position's, as every other position.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np
import torch

from oracles.fast_dllm import KVCache
from oracles.sdar import block_causal_mask

FAST_DLLM_V2_MASK_ID = 151665  # the tokenizer's additional special token |<MASK>| (not in config.json)
FAST_DLLM_V2_STOP_ID = 151645  # <|im_end|>
FAST_DLLM_V2_BD_SIZE = 32  # config.json's bd_size
FAST_DLLM_V2_SUB_BLOCK = 8  # small_block_size in their evaluation
FAST_DLLM_V2_THRESHOLD = 0.9  # their v2/eval.py harness default (read at NikhilSDate@734a60d4); batch_sample's: 0.95

CommitRule = Callable[[np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]  # (conf, pred, cand, step) -> bool


# ------------------------------------------------------------------------------------------------
# The network


def _qwen2_config(hf_config: Mapping):
    """transformers' Qwen2Config for a Fast_dLLM_Qwen config.json dict; refuses what it would get wrong."""
    from transformers import Qwen2Config

    cfg = dict(hf_config)
    if cfg.get("model_type", "Fast_dLLM_Qwen") not in ("Fast_dLLM_Qwen", "qwen2"):
        raise ValueError(f"model_type={cfg.get('model_type')!r}: not a Fast-dLLM v2 (Fast_dLLM_Qwen) config")
    if cfg.get("rope_scaling") is not None:
        raise ValueError(f"rope_scaling={cfg['rope_scaling']!r}: only plain RoPE is supported")
    if cfg.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r}: Qwen2's MLP is SwiGLU (silu)")
    heads = cfg["num_attention_heads"]
    qc = Qwen2Config(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, hidden_act="silu",
        max_position_embeddings=cfg.get("max_position_embeddings", 32768), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), use_sliding_window=False,
        attention_dropout=0.0, use_cache=False, attn_implementation="eager")
    qc.rope_parameters = {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}
    return qc


def fast_dllm_v2_torch_model(hf_config: Mapping, state_dict: Mapping[str, np.ndarray]) -> torch.nn.Module:
    """transformers' Qwen2ForCausalLM (fp32, eval, eager attention) holding a Fast-dLLM v2 checkpoint's tensors
    (their names are Qwen2's). A tied checkpoint has no lm_head.weight; an untied one must have it."""
    from transformers import Qwen2ForCausalLM

    cfg = _qwen2_config(hf_config)
    tensors = {k: torch.from_numpy(np.asarray(v, np.float32).copy()) for k, v in state_dict.items()}
    tied = cfg.tie_word_embeddings
    if tied:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise ValueError("tie_word_embeddings=false but the checkpoint has no lm_head.weight")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    result = model.load_state_dict(tensors, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if tied else set())
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint does not match Qwen2: missing {sorted(missing)}, "
                         f"unexpected {sorted(result.unexpected_keys)}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _cache_kwarg(model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`: pass whichever this version takes."""
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


@torch.no_grad()
def raw_logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, block_size: int) -> np.ndarray:
    """Unshifted logits [B, L, V] float32 under the block-causal mask (eager: the additive 4D mask as given)."""
    allowed, positions = block_causal_mask(mask, block_size)
    additive = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
    out = model(input_ids=torch.as_tensor(np.asarray(ids, np.int64)), attention_mask=torch.from_numpy(additive),
                position_ids=torch.from_numpy(positions), use_cache=False)
    return out.logits.float().numpy()


def shift(raw: np.ndarray) -> np.ndarray:
    """Dream's logit shift along axis -2: out[..., i, :] = raw[..., i - 1, :], out[..., 0, :] = raw[..., 0, :]."""
    return np.concatenate([raw[..., :1, :], raw[..., :-1, :]], axis=-2)


def block_causal_logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, block_size: int) -> np.ndarray:
    """The family's forward: logits [B, L, V] under the block-causal mask, shifted as Dream's (position i scored
    from hidden state i - 1; a left-padded row's first real position gets a padding position's row, as Dream's
    shift of the padded row does: it is a prompt position, never scored)."""
    return shift(raw_logits(model, ids, mask, block_size))


class BlockRunner(Protocol):
    """The three network calls batch_sample makes, on one row's tokens x[:block end] (positions 0.., unpadded)."""

    def exact(self, ids: np.ndarray) -> np.ndarray:
        """ids [n] -> raw (unshifted) logits [n, V] under the block-causal mask."""

    def full(self, ids: np.ndarray) -> np.ndarray:
        """As exact, keeping every layer's K/V of this pass (the block cache; replaces any kept before)."""

    def sub(self, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Only ids[lo:hi] run, at positions lo..hi-1, attending with no mask to every kept K/V after writing
        their own over the kept ones at [lo, hi) (in place: later sub passes see them) -> raw logits [hi-lo, V]."""


class Qwen2Runner:
    """BlockRunner over transformers' Qwen2ForCausalLM (`fast_dllm_v2_torch_model`)."""

    def __init__(self, model: torch.nn.Module, block_size: int):
        self.model, self.block_size = model, block_size
        self.cache: KVCache | None = None

    def exact(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)[None]
        return raw_logits(self.model, ids, np.ones(ids.shape, bool), self.block_size)[0]

    @torch.no_grad()
    def full(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)[None]
        allowed, positions = block_causal_mask(np.ones(ids.shape, bool), self.block_size)
        additive = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
        self.cache = KVCache()  # "record": every layer's K/V of this pass
        out = self.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(additive),
                         position_ids=torch.from_numpy(positions), use_cache=True,
                         **{_cache_kwarg(self.model): self.cache})
        return out.logits[0].float().numpy()

    @torch.no_grad()
    def sub(self, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
        if self.cache is None or self.cache.get_seq_length() != len(ids):
            raise RuntimeError("sub() needs a full() pass over the same prefix first")
        window = torch.as_tensor(np.asarray(ids[lo:hi], np.int64))[None]
        no_mask = torch.zeros(1, 1, hi - lo, len(ids))  # additive: every kept key visible
        out = self.model(input_ids=window, attention_mask=no_mask, position_ids=torch.arange(lo, hi)[None],
                         use_cache=True, **{_cache_kwarg(self.model): self.cache.replace_at(lo, hi)})
        return out.logits[0].float().numpy()


# ------------------------------------------------------------------------------------------------
# batch_sample, one row


def _greedy(logits: np.ndarray, never_predict: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(argmax [T], its float64 softmax probability [T]); lowest id on ties; never_predict keep their share."""
    z = np.asarray(logits, np.float64)
    choosable = z.copy()
    if len(never_predict):
        choosable[..., list(never_predict)] = -np.inf
    pred = choosable.argmax(axis=-1)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return pred.astype(np.int64), np.take_along_axis(e, pred[..., None], -1)[..., 0] / e.sum(axis=-1)


def threshold_commit(conf: np.ndarray, candidates: np.ndarray, threshold: float) -> np.ndarray:
    """Their rule in a sub-block: the candidates with conf > threshold (strict), plus the most confident
    candidate (first on ties)."""
    confidence = np.where(candidates, conf, -np.inf)
    take = confidence > threshold
    take[int(np.argmax(confidence))] = True
    return take & candidates


@dataclass
class V2Result:
    tokens: np.ndarray  # the canvas through the last decoded block (never-decoded blocks after it: masks)
    nfe: int  # denoise + store (the prefill not counted)
    denoise: int  # denoising passes
    store: int  # store passes (one per decoded block except the last)
    full_passes: int  # denoising passes that ran the whole block (all of them without the sub-block cache)
    sub_passes: int  # denoising passes that ran one sub-block (use_block_cache=True)
    blocks: int  # blocks decoded
    stop_index: int | None  # the first stop token at or after the prompt's end, if any
    free_tokens: list[int] = field(default_factory=list)  # positions that took a free token (prefill, store)
    log: list[dict] = field(default_factory=list)  # per denoising pass: block, sub_block, kind, committed


def batch_sample(runner: BlockRunner, prompt: Sequence[int] | np.ndarray, *, max_new_tokens: int,
                 block_size: int = FAST_DLLM_V2_BD_SIZE, small_block_size: int = FAST_DLLM_V2_SUB_BLOCK,
                 threshold: float = FAST_DLLM_V2_THRESHOLD, mask_id: int = FAST_DLLM_V2_MASK_ID,
                 stop_token: int = FAST_DLLM_V2_STOP_ID, use_block_cache: bool = False,
                 rule: CommitRule | None = None, never_predict: Sequence[int] = (), canvas: str = "authors",
                 stop_on_free_token: bool = False) -> V2Result:
    """Fast-dLLM v2's `batch_sample` for one prompt, greedy (see the module docstring for every step)."""
    prompt = np.asarray(prompt, np.int64)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt must be non-empty 1-D token ids, got shape {prompt.shape}")
    if mask_id in prompt:
        raise ValueError("the prompt holds the mask id: every mask in a block is decoded")
    if block_size % small_block_size:
        raise ValueError(f"small_block_size={small_block_size} must divide block_size={block_size}")
    if canvas not in ("authors", "sdar"):
        raise ValueError(f"canvas={canvas!r}; choose 'authors' or 'sdar'")
    P, bs, sb = prompt.size, block_size, small_block_size
    num_blocks = (max_new_tokens // bs + P // bs) if canvas == "authors" else -(-(P + max_new_tokens) // bs)
    x = np.full(max(num_blocks * bs, P), mask_id, np.int64)
    x[:P] = prompt
    result = V2Result(tokens=x, nfe=0, denoise=0, store=0, full_passes=0, sub_passes=0, blocks=0, stop_index=None)
    first = P // bs
    if first >= num_blocks:
        return result  # nothing to decode (their loop runs no block either)
    if P % bs == 0:  # the prefill's free token (not counted)
        x[P] = _greedy(runner.exact(x[:P])[-1:], never_predict)[0][0]
        result.free_tokens.append(P)
    finished = False
    for nb in range(first, num_blocks):
        lo, hi = nb * bs, (nb + 1) * bs
        have_block_cache = False  # their block_past_key_values = None at each block
        for s in range(bs // sb):
            slo, shi = lo + s * sb, lo + (s + 1) * sb
            step = 0
            while (x[slo:shi] == mask_id).any():
                candidates = x[slo:shi] == mask_id
                if use_block_cache and have_block_cache and x[slo] != mask_id:
                    logits = shift(runner.sub(x[:hi], slo, shi))  # shifted inside the window, as theirs
                    kind = "sub"
                    result.sub_passes += 1
                else:
                    raw = runner.full(x[:hi]) if use_block_cache else runner.exact(x[:hi])
                    have_block_cache = use_block_cache
                    logits = shift(raw)[slo:shi]
                    kind = "full"
                    result.full_passes += 1
                result.denoise += 1
                pred, conf = _greedy(logits, never_predict)
                if rule is None:
                    take = threshold_commit(conf, candidates, threshold)
                else:
                    take = np.asarray(rule(conf.copy(), pred.copy(), candidates.copy(), step), bool) & candidates
                    if not take.any():  # the loop contract: at least the most confident candidate
                        take[int(np.argmax(np.where(candidates, conf, -np.inf)))] = True
                x[slo:shi][take] = pred[take]
                finished |= bool((pred[take] == stop_token).any())
                result.log.append({"block": nb, "sub_block": s, "kind": kind,
                                   "committed": (slo + np.flatnonzero(take)).tolist()})
                step += 1
        result.blocks += 1
        if finished or nb + 1 == num_blocks:
            break
        x[hi] = _greedy(runner.exact(x[:hi])[-1:], never_predict)[0][0]  # the store pass's free token
        result.store += 1
        result.free_tokens.append(hi)
        if stop_on_free_token and x[hi] == stop_token:
            break
    result.nfe = result.denoise + result.store
    stops = np.flatnonzero(x[P:] == stop_token)
    result.stop_index = int(P + stops[0]) if stops.size else None
    return result

