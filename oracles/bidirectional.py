"""The independent PyTorch path: LLaDA run as transformers' Llama, and the published decode loops.

Tests use it as the oracle and benchmarks as the baseline, so it deliberately shares no code
with `model.py` or `decode.py`: weights come from LLaDA's own tensor names (not from the Flax
tree), attention is made bidirectional with an all-ones 4D mask, and decoding is a plain
Python loop per step in the style of LLaDA's `generate.py` (float64 softmax, top-k per row).

Needs torch (`pip install -e .[test]`).
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np
import torch

_BLOCK = re.compile(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.weight")
_BLOCK_TO_LLAMA = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",  # silu is applied to ff_proj
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_TOP_TO_LLAMA = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}


def llama_state_dict(llada: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LLaDA tensor names -> transformers LlamaForCausalLM names (both store Linear as [out, in])."""
    out = {}
    for name, t in llada.items():
        if name in _TOP_TO_LLAMA:
            out[_TOP_TO_LLAMA[name]] = t
        elif m := _BLOCK.fullmatch(name):
            out[f"model.layers.{m[1]}.{_BLOCK_TO_LLAMA[m[2]]}.weight"] = t
        else:
            raise KeyError(f"not a LLaDA tensor name: {name}")
    return out


def llama_from_llada(hf_config: Mapping, llada: Mapping[str, torch.Tensor], dtype=torch.float32,
                     device: str = "cpu"):
    """transformers' LlamaForCausalLM holding LLaDA's weights (run it with `bidirectional_logits`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d, nh = hf_config["d_model"], hf_config["n_heads"]
    cfg = LlamaConfig(
        vocab_size=hf_config.get("embedding_size") or hf_config["vocab_size"],
        hidden_size=d,
        intermediate_size=hf_config["mlp_hidden_size"],
        num_hidden_layers=hf_config["n_layers"],
        num_attention_heads=nh,
        num_key_value_heads=hf_config.get("n_kv_heads") or nh,
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-5),
        rope_theta=hf_config.get("rope_theta", 10000.0),
        max_position_embeddings=hf_config.get("max_sequence_length", 4096),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    # transformers >= 5 reads rope_theta from rope_parameters; older versions from rope_theta.
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(cfg.rope_theta if hasattr(cfg, "rope_theta") else hf_config.get("rope_theta", 10000.0))}
    cfg._attn_implementation = "sdpa"  # boolean 4D masks are honoured by SDPA (eager adds them as floats)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    state = {k: v.to(device=device, dtype=dtype) for k, v in llama_state_dict(llada).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


@torch.no_grad()
def bidirectional_logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, L, V] with every query seeing every real key (an all-ones 4D boolean mask)."""
    B, L = ids.shape
    if mask is None:
        mask = torch.ones(B, L, dtype=torch.bool, device=ids.device)
    mask = mask.bool()
    attn = mask[:, None, None, :].expand(B, 1, L, L).clone()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=attn, position_ids=positions).logits


def _rule_from_strategy(strategy: str, steps, kappa, tau, radius):
    """A rule by name, taking whichever of the DecodeConfig-style fields (steps, kappa, tau, radius) it has."""
    from oracles import rules as reference_rules

    given = {"steps": steps, "kappa": kappa, "tau": tau, "radius": radius}
    cls = reference_rules.RULES.get(strategy)
    return reference_rules.make(strategy, **{k: v for k, v in given.items() if cls and k in cls.defaults})


@torch.no_grad()
def eager_generate(model, ids: torch.Tensor, mask: torch.Tensor | None = None, *, strategy: str | None = None,
                   rule=None, gen_length: int, block_length: int, mask_id: int, eos_id: int,
                   eot_id: int | None = None, steps: int | None = None, kappa: float = 0.9, tau: float = 0.75,
                   radius: int = 4, early_stop: bool = False, logits_eos_inf: bool = False,
                   confidence_eos_eot_inf: bool = False, shift: int = 0, vocab_limit: int | None = None,
                   stats: dict | None = None, trace: dict | None = None) -> tuple[torch.Tensor, list[int]]:
    """The published decoding loop, step by step in Python (LLaDA `generate.py` / Fast-dLLM style).

    Rows of a batch move through blocks together, as in the published code; a row whose block is
    full waits (no commits, no NFE, its rule state untouched). Per pass: full bidirectional forward,
    Dream's shift if `shift` (position i scored by the hidden state at i-1), then per row in float64,
    at every position of the generated region (rules spec, "Common definitions"):
      head   = logits, EOS -inf if logits_eos_inf;  pred = argmax(head over ids < vocab_limit, but the mask)
      p      = softmax(head, with EOS and EOT also -inf if confidence_eos_eot_inf);  conf = p[pred]
    (the mask id and ids >= vocab_limit, which the tokenizer cannot decode, are never predicted but keep
    their softmax share)
    and the rule (a `reference_rules` object, one fresh copy per row, reset when the row enters a
    block) picks the commits among the block's still-masked positions. `strategy=` keeps the old
    form: a rule name whose settings come from the fields it has among steps, kappa, tau, radius
    ("low_confidence": steps, "threshold": kappa, "localleap": kappa, tau, radius); other settings
    keep their defaults (use `rule=` to set them).

    Returns (canvas [B, P+G], NFE per row). `stats`, if given, receives "passes" (forward passes of
    the batch) and counts of commits by clause name (the rule's `clauses`). `trace`, if given,
    receives per row and per forward pass of that row (its NFE order): "pred" [G] and "conf" [G] at
    every generated position, "commits" {generated position: clause}, and "block", "step_in_block".
    """
    from oracles import rules as reference_rules

    if (strategy is None) == (rule is None):
        raise ValueError("give exactly one of strategy= (a name) or rule= (a reference_rules object)")
    if rule is None:
        rule = _rule_from_strategy(strategy, steps, kappa, tau, radius)
    rule.bind(gen_length=gen_length, block_length=block_length)
    rules = [reference_rules.fresh(rule) for _ in range(ids.shape[0])]

    B, P = ids.shape
    if mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    x = torch.cat([ids, torch.full((B, gen_length), mask_id, dtype=ids.dtype, device=ids.device)], dim=1)
    attn = torch.cat([mask.bool(), torch.ones(B, gen_length, dtype=torch.bool, device=ids.device)], dim=1)
    num_blocks = gen_length // block_length
    nfe = [0] * B
    done = [False] * B
    if trace is not None:
        for key in ("pred", "conf", "commits", "block", "step_in_block"):
            trace[key] = [[] for _ in range(B)]
    for b in range(num_blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        step = [0] * B  # passes each row has worked in this block
        for r in range(B):
            rules[r].reset()
        while any(not done[r] and (x[r, lo:hi] == mask_id).any() for r in range(B)):
            logits = bidirectional_logits(model, x, attn)
            if shift:
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            logits = logits[:, P:].double()  # the generated region: [B, G, V]
            if stats is not None:
                stats["passes"] = stats.get("passes", 0) + 1
            if logits_eos_inf:
                logits[:, :, eos_id] = -float("inf")
            # Never predict the mask token or an id the tokenizer cannot decode (their softmax share stays).
            choosable = logits.clone()
            choosable[:, :, mask_id] = -float("inf")
            if vocab_limit is not None:
                choosable[:, :, vocab_limit:] = -float("inf")
            pred = choosable.argmax(-1)  # first maximum: lowest id on ties
            scored = logits.clone()
            if confidence_eos_eot_inf:
                scored[:, :, eos_id] = -float("inf")
                if eot_id is not None:
                    scored[:, :, eot_id] = -float("inf")
            p = torch.softmax(scored, dim=-1)
            conf = torch.gather(p, -1, pred[..., None])[..., 0]
            # Only what the rule reads leaves the device: [G] signals per row, whole [T, V] rows for KLASS.
            extra = {}
            if "margin" in rule.reads:
                top2 = p.topk(2, dim=-1).values
                extra["margin"] = (top2[..., 0] - top2[..., 1]).cpu().numpy()
            if "entropy" in rule.reads:
                extra["entropy"] = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1).cpu().numpy()
            pred_h, conf_h = pred.cpu().numpy(), conf.cpu().numpy()
            masked = (x[:, lo:hi] == mask_id).cpu().numpy()
            blk = slice(lo - P, hi - P)
            for r in range(B):
                cand = [] if done[r] else [int(j) for j in np.flatnonzero(masked[r])]
                if not cand:
                    continue
                nfe[r] += 1
                probs = p[r, blk].cpu().numpy() if "probs" in rule.reads else None
                commits = rules[r].select(step[r], cand, probs, pred_h[r, blk], conf_h[r, blk],
                                          **{k: v[r, blk] for k, v in extra.items()})
                top1 = min(cand, key=lambda j: (-conf_h[r, lo - P + j], j))
                assert commits and set(commits) <= set(cand), (rule, commits)
                assert commits.get(top1) == "top1" or not rules[r].commits_top1, (rule, commits)
                for j, clause in commits.items():
                    x[r, lo + j] = int(pred_h[r, lo - P + j])
                    if stats is not None:
                        stats[clause] = stats.get(clause, 0) + 1
                if trace is not None:
                    trace["pred"][r].append(pred_h[r].copy())
                    trace["conf"][r].append(conf_h[r].copy())
                    trace["commits"][r].append({b * block_length + j: c for j, c in commits.items()})
                    trace["block"][r].append(b)
                    trace["step_in_block"][r].append(step[r])
                step[r] += 1
        for r in range(B):
            if done[r]:
                continue
            if b == num_blocks - 1:
                done[r] = True
            elif early_stop and (x[r, lo:hi] == eos_id).any():
                x[r, hi:] = eos_id
                done[r] = True
    return x, nfe


# ---------------------------------------------------------------- Dream as transformers' Qwen2
# Dream's tensors already carry Qwen2's names (model.embed_tokens, model.layers.{i}.self_attn.q_proj
# with biases, mlp.gate_proj, ..., model.norm, lm_head), so they load into Qwen2ForCausalLM as they
# are. `bidirectional_logits` then gives the unshifted logits; Dream's one-position shift
# (`cat([l[:, :1], l[:, :-1]], 1)`) is the caller's to apply, as Dream's own generation code does.


def qwen2_from_dream(hf_config: Mapping, dream: Mapping[str, torch.Tensor], dtype=torch.float32,
                     device: str = "cpu"):
    """transformers' Qwen2ForCausalLM holding Dream's weights (run it with `bidirectional_logits`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    n_heads = hf_config["num_attention_heads"]
    cfg = Qwen2Config(
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_hidden_layers=hf_config["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=hf_config.get("num_key_value_heads") or n_heads,
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=hf_config.get("rope_theta", 10000.0),
        max_position_embeddings=hf_config.get("max_position_embeddings", 32768),
        tie_word_embeddings=False,
        use_sliding_window=False,
        hidden_act="silu",
    )
    # transformers >= 5 reads rope_theta from rope_parameters; older versions from rope_theta.
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(hf_config.get("rope_theta", 10000.0))}
    cfg._attn_implementation = "sdpa"  # boolean 4D masks are honoured by SDPA
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in dream.items()}, strict=True)
    return model.eval()
