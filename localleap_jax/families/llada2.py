"""LLaDA2.x (inclusionAI/LLaDA2.0-mini, -flash; LLaDA2.1-mini, -flash): a block-diffusion mixture of experts on the
Ling-2.0 body (config.json model_type "llada2_moe").

The network is model.py's with these switches: per-head q/k RMSNorm before RoPE (`attention.query_layernorm`,
`key_layernorm`), NeoX rotary on the first `partial_rotary_factor` (0.5) of head_dim, GQA, no biases, an untied head,
a dense SwiGLU on the first `first_k_dense_replace` layers and a MoE feed-forward after (localleap_jax.moe): the
router in fp32, s = sigmoid(h W_g^T), the choice on s + expert_bias, group-limited (each of `n_group` groups scored
by the sum of its top-2 biased scores, the best `topk_group` kept), the top `num_experts_per_tok`, the weights the
UNbiased s renormalised times `routed_scaling_factor`, plus `num_shared_experts` shared experts. The fused
`attention.query_key_value` (rows Q, K, V, head-major) is split into q/k/v at conversion. Attention is
block-causal on each row's grid from its first real token, like SDAR's, but the block is a decoding setting here
(the attention grid follows DecodeConfig.block_length; 32 when none is given, the authors' default).

config.json names no mask id, eos id or block size: the converter reads `<|mask|>` (156895) and `<|endoftext|>`
(156892, also pad) from the tokenizer. The authors' `generate` (block 32, threshold 0.95, steps = the block length
per block) is the `dynamic` rule with early stop.

Traps in the authors' code, written down here as the issue asks:
  * `generate(temperature=0)` still samples (it skips the division, then calls `multinomial` at temperature 1):
    greedy here is the argmax, with its softmax probability as the confidence.
  * The gate renormalises whenever top_k > 1, whatever `norm_topk_prob` says, and ignores `score_function`,
    `router_dtype`, `moe_router_enable_expert_bias` (the bias buffer always exists), `rotary_dim`, `use_qk_norm`:
    followed (those keys are not read).
  * LLaDA2MoeConfig's default `use_bias` is true (a bias on the attention output) when config.json omits it: the
    releases say false; a config without the key, or with true, is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError
from localleap_jax.families import Family
from localleap_jax.families.fields import fill_token_id, positive, refuse, whole
from localleap_jax.families.target import Target
from localleap_jax.model import layer_slot
from localleap_jax.moe import MoE, MoELayers, Router

MASK_TOKEN = "<|mask|>"
EOS_TOKEN = "<|endoftext|>"
DEFAULT_BLOCK_SIZE = 32  # the authors' generate's block_length (the reports' setting)


def read(cfg: Mapping[str, Any]) -> ModelConfig:
    bad = []
    for key in ("use_bias", "use_qkv_bias"):
        if cfg.get(key, key == "use_bias"):
            bad.append(f"{key}={cfg.get(key)!r} (the released checkpoints have no biases; LLaDA2MoeConfig's default for "
                       "a missing use_bias is true)")
    if cfg.get("norm_head"):
        bad.append("norm_head=true (a normalised LM head is not implemented)")
    if cfg.get("rope_scaling") is not None:
        bad.append(f"rope_scaling={cfg['rope_scaling']!r} (only plain RoPE is implemented)")
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu' is implemented)")
    if cfg.get("tie_word_embeddings"):
        bad.append("tie_word_embeddings=true (LLaDA2's head is untied)")
    refuse(bad)
    for key in ("mask_token_id", "eos_token_id"):
        if cfg.get(key) is None:
            raise ConfigError(f"config.json has no {key} (LLaDA2's tokenizer names it): convert the checkpoint with "
                              "`python -m convert SRC OUT`, which reads it from the tokenizer")
    d_model, n_heads = whole(cfg, "hidden_size"), whole(cfg, "num_attention_heads")
    head_dim = whole(cfg, "head_dim", default=d_model // n_heads)
    factor = positive(cfg, "partial_rotary_factor", 0.5)
    rotary_dim = int(head_dim * factor)
    n_layers = whole(cfg, "num_hidden_layers")
    dense = whole(cfg, "first_k_dense_replace", default=0, minimum=0)
    experts, top_k = whole(cfg, "num_experts"), whole(cfg, "num_experts_per_tok")
    expert_hidden = whole(cfg, "moe_intermediate_size")
    shared = whole(cfg, "num_shared_experts", default=0, minimum=0)
    router = Router(num_experts=experts, top_k=top_k, score="sigmoid", bias="select",
                    n_group=whole(cfg, "n_group", default=1), topk_group=whole(cfg, "topk_group", default=1),
                    normalise=top_k > 1, scale=positive(cfg, "routed_scaling_factor", 1.0))
    arch = MoELayers(MoE(router), layers=tuple(i >= dense for i in range(n_layers)), expert_hidden=expert_hidden,
                     shared_hidden=shared * expert_hidden, expert_bias=True)
    vocab, eos = whole(cfg, "vocab_size"), whole(cfg, "eos_token_id", minimum=0)
    return ModelConfig(
        d_model=d_model, n_heads=n_heads, n_kv_heads=whole(cfg, "num_key_value_heads", default=n_heads),
        n_layers=n_layers, mlp_hidden_size=whole(cfg, "intermediate_size"), vocab_size=vocab, embedding_size=vocab,
        rope_theta=positive(cfg, "rope_theta", 10000.0), rms_norm_eps=positive(cfg, "rms_norm_eps", 1e-5),
        max_sequence_length=whole(cfg, "max_position_embeddings", default=32768),
        mask_token_id=whole(cfg, "mask_token_id", minimum=0), eos_token_id=eos,
        pad_token_id=whole(cfg, "pad_token_id", default=eos, minimum=0),
        family="llada2", qk_norm=True, explicit_head_dim=head_dim, rotary_dim=rotary_dim,
        block_size=whole(cfg, "block_size", default=DEFAULT_BLOCK_SIZE), flexible_block=True, arch=arch,
        delete_token_id=edit_id(cfg, "delete_token_id"), split_token_id=edit_id(cfg, "split_token_id"))


def edit_id(cfg: Mapping[str, Any], key: str) -> int | None:
    """LLaDA2.2's DELETE / SPLIT id from config.json (SGLang reads them there), or None where the checkpoint has none
    (LLaDA2.0 / 2.1)."""
    return None if cfg.get(key) is None else whole(cfg, key, minimum=0)


def write(c: ModelConfig) -> dict[str, Any]:
    a: MoELayers = c.arch
    r = a.moe.router
    return {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "hidden_size": c.d_model, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "num_hidden_layers": c.n_layers, "intermediate_size": c.mlp_hidden_size,
        "moe_intermediate_size": a.expert_hidden, "num_experts": r.num_experts, "num_experts_per_tok": r.top_k,
        "num_shared_experts": a.shared_hidden // a.expert_hidden, "first_k_dense_replace": a.layers.index(True)
        if True in a.layers else c.n_layers, "n_group": r.n_group, "topk_group": r.topk_group,
        "routed_scaling_factor": r.scale, "score_function": "sigmoid", "norm_topk_prob": True,
        "partial_rotary_factor": c.rotary_dim / c.head_dim, "rope_theta": c.rope_theta, "rope_scaling": None,
        "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_sequence_length,
        "use_bias": False, "use_qkv_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "mask_token_id": c.mask_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
        "block_size": c.block_size,
        **{k: v for k, v in (("delete_token_id", c.delete_token_id), ("split_token_id", c.split_token_id))
           if v is not None}}


def tensor_map(config: ModelConfig) -> dict[str, Target | tuple[Target, ...]]:
    c, a = config, config.arch
    out: dict[str, Target | tuple[Target, ...]] = {
        "model.word_embeddings.weight": Target(("wte", "embedding"), None, False),
        "model.norm.weight": Target(("ln_f", "scale"), None, False),
        "lm_head.weight": Target(("ff_out", "kernel"), None, True),
    }
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for i in range(c.n_layers):
        stack, j = layer_slot(c, i)
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": Target((stack, "attn_norm", "scale"), j, False),
            p + "post_attention_layernorm.weight": Target((stack, "ff_norm", "scale"), j, False),
            p + "attention.query_layernorm.weight": Target((stack, "q_norm", "scale"), j, False),
            p + "attention.key_layernorm.weight": Target((stack, "k_norm", "scale"), j, False),
            p + "attention.dense.weight": Target((stack, "attn_out", "kernel"), j, True),
            p + "attention.query_key_value.weight": (  # rows Q, K, V (head-major): split at conversion
                Target((stack, "q_proj", "kernel"), j, True, (0, q)),
                Target((stack, "k_proj", "kernel"), j, True, (q, q + kv)),
                Target((stack, "v_proj", "kernel"), j, True, (q + kv, q + 2 * kv))),
        }
        if not a.layers[i]:
            out |= {p + f"mlp.{hf}.weight": Target((stack, ours, "kernel"), j, True)
                    for hf, ours in (("gate_proj", "ff_proj"), ("up_proj", "up_proj"), ("down_proj", "ff_out"))}
            continue
        out |= moe_tensors(a, stack, j, gate=p + "mlp.gate.weight", bias=p + "mlp.gate.expert_bias",
                           experts=p + "mlp.experts", shared=p + "mlp.shared_experts")
    return out


def moe_tensors(arch: MoELayers, stack: str, j: int, *, gate: str, bias: str, experts: str, shared: str
                ) -> dict[str, Target]:
    """A MoE feed-forward's tensors (model.py's `moe` leaves of layer j of `stack`), named as the family names them:
    its router `gate`, its expert `bias` (when the router has one), `experts.{e}.{gate,up,down}_proj` and the
    `shared.{gate,up,down}_proj` experts (when it has them)."""
    moe = (stack, "moe")
    out = {gate: Target((*moe, "gate", "kernel"), j, True)}
    if arch.expert_bias:
        out[bias] = Target((*moe, "expert_bias"), j, False)
    for e in range(arch.moe.router.num_experts):
        out |= {f"{experts}.{e}.{n}.weight": Target((*moe, "experts", n), (j, e), True)
                for n in ("gate_proj", "up_proj", "down_proj")}
    if arch.shared_hidden:
        out |= {f"{shared}.{n}.weight": Target((*moe, f"shared_{n}", "kernel"), j, True)
                for n in ("gate_proj", "up_proj", "down_proj")}
    return out


def complete_config(src: Path, hf_config: dict) -> dict:
    """The mask and EOS ids (the tokenizer's <|mask|> and <|endoftext|>, also pad), which config.json lacks."""
    out = dict(hf_config)
    fill_token_id(out, "mask_token_id", src, MASK_TOKEN, role="mask_token")
    fill_token_id(out, "eos_token_id", src, EOS_TOKEN, role="eos_token")
    out.setdefault("pad_token_id", out["eos_token_id"])
    return out


FAMILY = Family(
    name="llada2", title="LLaDA2", model_types=("llada2_moe",), architectures=("LLaDA2Moe",),
    read=read, write=write, tensor_map=tensor_map, mask_token=MASK_TOKEN, chat_format="chatml",
    complete_config=complete_config,
    likelihood=None, likelihood_refusal="likelihood of LLaDA2 (block diffusion) is not served: its authors publish "
    "no estimator, and a block-causal mask changes what a masked token sees",
    eval_strategies="low_confidence,dynamic:threshold=0.95,threshold,localleap")
