"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct): LLaDA's bidirectional diffusion on an OLMoE-like
mixture of experts. config.json has model_type "llada" like dense LLaDA, told apart by architectures
["LLaDAMoEModelLM"] (and its keys: dense/expert/shared_expert_intermediate_size, moe_layer_freq, ...).

The network is model.py's with: per-head q/k RMSNorm of head_dim before RoPE (`self_attn.{q,k}_norm`, with
`qk_layernorm`), NeoX rotary on the first `partial_rotary_factor` of head_dim, bidirectional attention, a dense
SwiGLU (`dense_intermediate_size`) where `moe_layer_freq[i]` is 0 and a MoE feed-forward elsewhere: softmax top-k
router in fp32 without renormalisation, the expert bias (with `moe_router_enable_expert_bias`) ADDED to the
probabilities that become the weights, and a layer-level shared expert (`model.layers.{i}.shared_expert.*`, with
`shared_expert_intermediate_size`). LLaDA's decoding, caches (prefix, dual) and likelihood estimator apply.

Traps in the authors' code, written down here as the issue asks: the gate adds the expert bias to the
probabilities that become the weights, never renormalises, and ignores `routed_scaling_factor`, the group keys and
`moe_router_score_function` (followed: those keys are not read); their attention ignores any padding mask (not
followed: padding is never attended, so a left-padded row equals itself alone). config.json names no mask id: the
converter reads `<|mask|>` (156895) from the tokenizer; EOS `<|endoftext|>` (156892) = pad.
"""

from __future__ import annotations

from typing import Any, Mapping

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError
from localleap_jax.families import Family
from localleap_jax.families.fields import flag, positive, refuse, whole
from localleap_jax.families.llada2 import MASK_TOKEN, complete_config, moe_tensors
from localleap_jax.families.target import Target
from localleap_jax.model import layer_slot
from localleap_jax.moe import MoE, MoELayers, Router


def read(cfg: Mapping[str, Any]) -> ModelConfig:
    bad = []
    if cfg.get("attention_bias"):
        bad.append("attention_bias=true (q/k/v/o biases are not implemented)")
    if cfg.get("clip_qkv") is not None:
        bad.append(f"clip_qkv={cfg['clip_qkv']!r} (clamping q/k/v is not implemented)")
    if cfg.get("rope_scaling") is not None:
        bad.append(f"rope_scaling={cfg['rope_scaling']!r} (only plain RoPE is implemented)")
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu' is implemented)")
    refuse(bad)
    for key in ("mask_token_id", "eos_token_id"):
        if cfg.get(key) is None:
            raise ConfigError(f"config.json has no {key} (LLaDA-MoE's tokenizer names it): convert the checkpoint with "
                              "`python -m convert SRC OUT`, which reads it from the tokenizer")
    d_model, n_heads = whole(cfg, "hidden_size"), whole(cfg, "num_attention_heads")
    n_layers = whole(cfg, "num_hidden_layers")
    freq = cfg.get("moe_layer_freq")
    if not isinstance(freq, list) or len(freq) != n_layers or not all(isinstance(f, int) for f in freq):
        raise ConfigError(f"config.json moe_layer_freq={freq!r} must list one integer per layer ({n_layers})")
    head_dim = d_model // n_heads
    factor = cfg.get("partial_rotary_factor")
    if factor is None or isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ConfigError(f"config.json partial_rotary_factor={factor!r} must be a positive number (LLaDAConfig's "
                          "default, -1, means nothing: the file must give it)")
    shared = cfg.get("shared_expert_intermediate_size")
    bias = flag(cfg, "moe_router_enable_expert_bias", False)
    experts, top_k = whole(cfg, "num_experts"), whole(cfg, "num_experts_per_tok")
    arch = MoELayers(MoE(Router(num_experts=experts, top_k=top_k, score="softmax", bias="weights" if bias else None)),
                     layers=tuple(f != 0 for f in freq), expert_hidden=whole(cfg, "expert_intermediate_size"),
                     shared_hidden=0 if shared is None else whole(cfg, "shared_expert_intermediate_size"),
                     expert_bias=bias)
    vocab, eos = whole(cfg, "vocab_size"), whole(cfg, "eos_token_id", minimum=0)
    return ModelConfig(
        d_model=d_model, n_heads=n_heads, n_kv_heads=whole(cfg, "num_key_value_heads", default=n_heads),
        n_layers=n_layers, mlp_hidden_size=whole(cfg, "dense_intermediate_size"), vocab_size=vocab,
        embedding_size=vocab, rope_theta=positive(cfg, "rope_theta", 10000.0),
        rms_norm_eps=positive(cfg, "rms_norm_eps", 1e-5),
        max_sequence_length=whole(cfg, "max_position_embeddings", default=8192),
        mask_token_id=whole(cfg, "mask_token_id", minimum=0), eos_token_id=eos,
        pad_token_id=whole(cfg, "pad_token_id", default=eos, minimum=0), family="llada_moe",
        qk_norm=flag(cfg, "qk_layernorm", False), rotary_dim=int(head_dim * factor),
        tie_word_embeddings=flag(cfg, "tie_word_embeddings", False), arch=arch)


def write(c: ModelConfig) -> dict[str, Any]:
    a: MoELayers = c.arch
    return {
        "architectures": ["LLaDAMoEModelLM"], "model_type": "llada",
        "hidden_size": c.d_model, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "num_hidden_layers": c.n_layers, "dense_intermediate_size": c.mlp_hidden_size,
        "expert_intermediate_size": a.expert_hidden, "shared_expert_intermediate_size": a.shared_hidden or None,
        "num_experts": a.moe.router.num_experts, "num_experts_per_tok": a.moe.router.top_k,
        "moe_layer_freq": [int(m) for m in a.layers], "moe_router_enable_expert_bias": a.expert_bias,
        "qk_layernorm": c.qk_norm, "partial_rotary_factor": c.rotary_dim / c.head_dim, "rope_theta": c.rope_theta,
        "rope_scaling": None, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_sequence_length, "attention_bias": False, "clip_qkv": None,
        "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu", "mask_token_id": c.mask_token_id,
        "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}


def tensor_map(config: ModelConfig) -> dict[str, Target]:
    c, a = config, config.arch
    out = {"model.embed_tokens.weight": Target(("wte", "embedding"), None, False),
           "model.norm.weight": Target(("ln_f", "scale"), None, False)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = Target(("ff_out", "kernel"), None, True)
    for i in range(c.n_layers):
        stack, j = layer_slot(c, i)
        p = f"model.layers.{i}."
        out |= {p + f"{hf}.weight": Target((stack, ours, "scale"), j, False)
                for hf, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ff_norm"))}
        out |= {p + f"self_attn.{hf}.weight": Target((stack, ours, "kernel"), j, True)
                for hf, ours in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("o_proj", "attn_out"))}
        if c.qk_norm:
            out |= {p + f"self_attn.{n}.weight": Target((stack, n, "scale"), j, False) for n in ("q_norm", "k_norm")}
        if not a.layers[i]:
            out |= {p + f"mlp.{hf}.weight": Target((stack, ours, "kernel"), j, True)
                    for hf, ours in (("gate_proj", "ff_proj"), ("up_proj", "up_proj"), ("down_proj", "ff_out"))}
            continue
        out |= moe_tensors(a, stack, j, gate=p + "mlp.gate.weight", bias=p + "mlp.expert_bias",
                           experts=p + "mlp.experts", shared=p + "shared_expert")  # a layer-level shared expert
    return out


FAMILY = Family(
    name="llada_moe", title="LLaDA-MoE", model_types=("llada",), architectures=("LLaDAMoE",), key_hint="moe_layer_freq",
    read=read, write=write, tensor_map=tensor_map, mask_token=MASK_TOKEN, chat_format="chatml",
    complete_config=complete_config, likelihood="llada")
