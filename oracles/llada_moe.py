"""An eager PyTorch oracle for LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base / -Instruct), for tests only: the
network from the checkpoint's own (HF) tensor names under a bidirectional mask. Decoding is LLaDA's (its
`generate`, Fast-dLLM's caches, the likelihood estimator: see oracles/bidirectional.py and oracles/fast_dllm.py,
run over this module's `llada_moe_logits_fn`).

What was read (public code, transcribed here, not copied):
  * inclusionAI/dInfer@fce4e328 `tools/modeling_fused_lladamoe.py` and `tools/configuration_lladamoe.py`
    (LLaDAConfig: dense_intermediate_size, expert_intermediate_size, shared_expert_intermediate_size,
    moe_layer_freq, qk_layernorm, moe_router_enable_expert_bias, clip_qkv, partial_rotary_factor, ...).
  * The hub's `modeling_lladamoe.py` as stored in InfiniTensor/InfiniLM@0a7e522a (LLaDAMoESparseMoeBlock with
    the `mlp.experts.{e}.*` ModuleList, LLaDAMoEDecoderLayer with its `shared_expert`, LLaDAMoEAttention).
  * ../shared/reference/llada2-moe.md (LLaDA-MoE section).

The network, per layer (pre-norm, residual around each half; head_dim = hidden_size / num_attention_heads):
    Q = q_proj(h), K = k_proj(h), V = v_proj(h); with qk_layernorm: Q, K RMSNorm'd per head (over head_dim,
    `self_attn.{q,k}_norm`) BEFORE RoPE; with clip_qkv: Q, K, V clamped to [-clip, clip] after that
    NeoX RoPE on the first int(head_dim * partial_rotary_factor) dims; attention over every real key
    (bidirectional), GQA; `o_proj`
    MLP: `moe_layer_freq[i] == 0`: dense SwiGLU `mlp.{gate,up,down}_proj` (dense_intermediate_size); else MoE:
        probs = softmax(h W_g^T) (fp32); with moe_router_enable_expert_bias: probs += `mlp.expert_bias`;
        the top num_experts_per_tok of those values are both the choice AND the weights (no renormalisation:
        norm_topk_prob is hard-coded False); y = sum_k w_k SwiGLU_{idx_k}(h) (expert_intermediate_size)
        + `shared_expert` SwiGLU(h) when shared_expert_intermediate_size is set (a LAYER-level module:
        `model.layers.{i}.shared_expert.*`, not under `mlp.`; MoE layers only)
    final RMSNorm `model.norm`, `lm_head` (the embedding when tie_word_embeddings and no lm_head.weight).

Traps of the authors' code: the gate ADDS the expert bias to the probabilities that become the weights (unlike
LLaDA2, whose bias only selects), never renormalises, and ignores routed_scaling_factor, router_num_group /
router_topk_group and moe_router_score_function (always softmax): all followed. Their attention ignores any
mask (`attention_mask = None`, so left padding is attended): NOT followed; here padding is never attended and
positions count from each row's first real token, so a left-padded row equals itself alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from oracles.llada2 import attention, moe, rms_norm, rope, swiglu

LLADA_MOE_MASK_ID = 156895  # Ling tokenizer's <|mask|> (not in config.json)
LLADA_MOE_EOS_ID = 156892  # <|endoftext|>

LogitsFn = Callable[[np.ndarray], np.ndarray]  # ids [1, n] -> bidirectional logits [1, n, V]


@dataclass(frozen=True)
class LLaDAMoEConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    dense_intermediate_size: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    num_experts: int
    top_k: int
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense
    expert_bias: bool
    qk_layernorm: bool
    clip_qkv: float | None
    tied: bool


def llada_moe_config(hf_config: Mapping) -> LLaDAMoEConfig:
    """The fields the network reads, from a config.json dict; refuses what this oracle would silently get wrong."""
    cfg = dict(hf_config)
    if cfg.get("model_type") != "llada" or "LLaDAMoEModelLM" not in cfg.get("architectures", ["LLaDAMoEModelLM"]):
        raise ValueError("not a LLaDA-MoE config (model_type 'llada', architectures ['LLaDAMoEModelLM'])")
    if cfg.get("attention_bias", False):
        raise ValueError("attention_bias=true: this oracle loads no q/k/v/o biases")
    if cfg.get("rope_scaling") is not None:
        raise ValueError(f"rope_scaling={cfg['rope_scaling']!r}: only plain RoPE is transcribed")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r}: LLaDA-MoE's MLPs are SwiGLU (silu)")
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if cfg["hidden_size"] % heads or heads % kv_heads:
        raise ValueError("hidden_size must split into num_attention_heads heads, and those into KV groups")
    head_dim = cfg["hidden_size"] // heads
    factor = cfg.get("partial_rotary_factor", 1.0)
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim % 2:  # LLaDAConfig's default factor is -1: a config must give it
        raise ValueError(f"partial_rotary_factor={factor!r} gives rotary dim {rotary_dim}: must be positive, even")
    freq = list(cfg.get("moe_layer_freq") or [])
    if len(freq) != layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {layers} layers")
    shared = cfg.get("shared_expert_intermediate_size")
    if shared is not None and shared <= 0:
        raise ValueError(f"shared_expert_intermediate_size={shared!r}: null (no shared expert) or positive")
    return LLaDAMoEConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
        rope_theta=float(cfg["rope_theta"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        dense_intermediate_size=cfg["dense_intermediate_size"],
        expert_intermediate_size=cfg["expert_intermediate_size"], shared_expert_intermediate_size=int(shared or 0),
        num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
        moe_layers=tuple(int(f) != 0 for f in freq), expert_bias=bool(cfg.get("moe_router_enable_expert_bias")),
        qk_layernorm=bool(cfg.get("qk_layernorm")), clip_qkv=cfg.get("clip_qkv"),
        tied=bool(cfg.get("tie_word_embeddings", False)))


def route_softmax_topk(h: torch.Tensor, gate: torch.Tensor, expert_bias: torch.Tensor | None, *, top_k: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA-MoE's gate: (expert ids [T, k], weights [T, k]) = top-k of softmax(h W_g^T) (+ expert_bias), the
    biased values themselves as weights, no renormalisation. Ties as torch.topk puts them (the authors' call)."""
    probs = torch.softmax(h @ gate.T, dim=-1)
    if expert_bias is not None:
        probs = probs + expert_bias
    w, idx = probs.topk(top_k, dim=-1)
    return idx, w


class LLaDAMoENetwork:
    """LLaDA-MoE from its HF tensors: `net(ids [B, L], allowed [B, L, L], positions [B, L]) -> logits [B, L, V]`.

    Build `allowed` / `positions` with `bidirectional_mask`. The router runs in max(dtype, float32)."""

    def __init__(self, hf_config: Mapping, tensors: Mapping[str, np.ndarray], dtype: torch.dtype = torch.float32):
        self.config = c = llada_moe_config(hf_config)
        self.dtype = dtype
        t = {k: torch.as_tensor(np.asarray(v), dtype=dtype) for k, v in tensors.items()}
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in t:
                raise KeyError(f"checkpoint has no {name}")
            used.add(name)
            return t[name]

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        if "lm_head.weight" in t or not c.tied:
            self.head = take("lm_head.weight")
        else:
            self.head = self.embed
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = {"input_norm": take(p + "input_layernorm.weight"),
                     "post_norm": take(p + "post_attention_layernorm.weight"),
                     **{n: take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v", "o")}}
            if c.qk_layernorm:
                layer["q_norm"] = take(p + "self_attn.q_norm.weight")
                layer["k_norm"] = take(p + "self_attn.k_norm.weight")
            if not c.moe_layers[i]:
                layer["mlp"] = tuple(take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
            else:
                layer["gate"] = take(p + "mlp.gate.weight")
                layer["expert_bias"] = take(p + "mlp.expert_bias") if c.expert_bias else None
                layer["experts"] = [tuple(take(p + f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))
                                    for e in range(c.num_experts)]
                if c.shared_expert_intermediate_size:
                    layer["shared"] = tuple(take(p + f"shared_expert.{n}_proj.weight")
                                            for n in ("gate", "up", "down"))
            self.layers.append(layer)
        unused = sorted(set(t) - used)
        if unused:
            raise ValueError(f"tensors this oracle does not read (a layout it does not know): {unused[:8]}")

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate of MoE layer `layer` for tokens h [T, H] -> (idx [T, k], weights [T, k])."""
        p = self.layers[layer]
        rdt = torch.promote_types(self.dtype, torch.float32)
        bias = None if p["expert_bias"] is None else p["expert_bias"].to(rdt)
        return route_softmax_topk(h.to(rdt), p["gate"].to(rdt), bias, top_k=self.config.top_k)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = self.layers[layer]
        if "mlp" in p:
            return swiglu(x, *p["mlp"])
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.route(layer, flat)
        y = moe(flat, idx, w, p["experts"])
        if "shared" in p:
            y = y + swiglu(flat, *p["shared"])
        return y.reshape(shape)

    def attend(self, layer: int, x: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c, p = self.config, self.layers[layer]
        B, L, _ = x.shape

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(B, L, n, c.head_dim).transpose(1, 2)

        q, k, v = heads(x @ p["q"].T, c.num_heads), heads(x @ p["k"].T, c.num_kv_heads), heads(x @ p["v"].T,
                                                                                                c.num_kv_heads)
        if c.qk_layernorm:
            q, k = rms_norm(q, p["q_norm"], c.rms_norm_eps), rms_norm(k, p["k_norm"], c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k = rope(q, positions, c.rotary_dim, c.rope_theta), rope(k, positions, c.rotary_dim, c.rope_theta)
        return attention(q, k, v, allowed) @ p["o"].T

    @torch.no_grad()
    def __call__(self, ids, allowed, positions, embeds: torch.Tensor | None = None) -> np.ndarray:
        """`embeds` [B, L, H]: input embeddings in place of the ids' (dInfer's iteration smoothing feeds them)."""
        c = self.config
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        allowed = torch.as_tensor(np.asarray(allowed), dtype=torch.bool)
        positions = torch.as_tensor(np.asarray(positions), dtype=torch.long)
        if ids.ndim != 2 or allowed.shape != (*ids.shape, ids.shape[1]) or positions.shape != ids.shape:
            raise ValueError(f"ids {tuple(ids.shape)}, allowed {tuple(allowed.shape)}, positions "
                             f"{tuple(positions.shape)}: expected [B, L], [B, L, L], [B, L]")
        h = self.embed[ids] if embeds is None else torch.as_tensor(embeds, dtype=self.dtype)
        for i in range(c.num_layers):
            h = h + self.attend(i, rms_norm(h, self.layers[i]["input_norm"], c.rms_norm_eps), allowed, positions)
            h = h + self.mlp(i, rms_norm(h, self.layers[i]["post_norm"], c.rms_norm_eps))
        return (rms_norm(h, self.norm, c.rms_norm_eps) @ self.head.T).numpy()


def bidirectional_mask(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(allowed [B, L, L], positions [B, L]) for a left-padded batch: every query sees every real key; positions
    count from the row's first real token; a padding query sees only itself (keeps its softmax finite)."""
    mask = np.asarray(mask, bool)
    if mask.ndim != 2 or not mask.any(axis=1).all():
        raise ValueError("mask must be [B, L] with at least one real token per row")
    B, L = mask.shape
    allowed = np.broadcast_to(mask[:, None, :], (B, L, L)).copy()
    allowed[:, np.arange(L), np.arange(L)] |= ~mask
    return allowed, np.maximum(np.arange(L)[None, :] - mask.argmax(axis=1)[:, None], 0)


def bidirectional_logits(net: LLaDAMoENetwork, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Logits [B, L, V] of a left-padded batch, bidirectional (no shift)."""
    allowed, positions = bidirectional_mask(mask)
    return net(ids, allowed, positions)


def llada_moe_logits_fn(net: LLaDAMoENetwork) -> LogitsFn:
    """ids [1, n] (unpadded) -> logits [1, n, V], for loops written over a `logits_fn`."""
    return lambda ids: bidirectional_logits(net, ids, np.ones(np.shape(ids), bool))

