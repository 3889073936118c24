"""LLaDA (GSAI-ML/LLaDA-8B-Base and -Instruct): a Llama block with bidirectional attention, OLMo-style names.

config.json: LLaDA's OLMo-style keys (d_model, n_heads, mlp_hidden_size or mlp_ratio, ...). Every OLMo switch
that would change the network in a way model.py does not implement is refused by name, never ignored.
Tensors: `model.transformer.{wte, blocks.{i}.*, ln_f, ff_out}.weight`, no biases, untied head; MLP
ff_out(silu(ff_proj x) * up_proj x). Mask `<|mdm_mask|>` (126336 in the released tokenizer, read from config.json).
"""

from __future__ import annotations

from typing import Any, Mapping

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError
from localleap_jax.families import Family
from localleap_jax.families.fields import positive, refuse, whole
from localleap_jax.families.target import Target
from localleap_jax.tokenizer import MASK_TOKEN

# Flags that must be false/absent: each changes the network in a way model.py does not implement.
MUST_BE_FALSE = ("alibi", "include_bias", "include_qkv_bias", "weight_tying", "attention_layer_norm", "scale_logits",
                 "input_emb_norm", "multi_query_attention", "clip_qkv", "bias_for_layer_norm")
# Fields that must hold one specific value, and be present: LLaDA's own defaults for them (OLMo's: a sequential
# block, no RoPE, ...) describe a different network.
MUST_EQUAL = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True}
# Fields that may be absent but, when present, must hold this value.
IF_PRESENT = {
    "layer_norm_with_affine": True,  # false: RMSNorm without a scale
    "rope_full_precision": True,  # false: RoPE in the activation dtype; ours is always fp32
    "rope_scaling": None,  # not an OLMo field, but never silently ignored
}


def read(cfg: Mapping[str, Any]) -> ModelConfig:
    bad = [k for k in MUST_BE_FALSE if cfg.get(k)]
    bad += [(f"{k}={cfg[k]!r}" if k in cfg else f"{k} missing") + f" (only {v!r} is implemented)"
            for k, v in MUST_EQUAL.items() if cfg.get(k) != v]
    bad += [f"{k}={cfg[k]!r} (only {v!r} is implemented)" for k, v in IF_PRESENT.items() if k in cfg and cfg[k] != v]
    refuse(sorted(bad))
    d_model = whole(cfg, "d_model")
    n_heads = whole(cfg, "n_heads")
    if cfg.get("mlp_hidden_size") is not None:
        mlp = whole(cfg, "mlp_hidden_size")
    elif cfg.get("mlp_ratio") is None:
        raise ConfigError("config.json has neither mlp_hidden_size nor mlp_ratio")
    else:
        ratio = positive(cfg, "mlp_ratio", None)
        if not float(ratio * d_model).is_integer():
            raise ConfigError(f"config.json mlp_ratio={ratio} times d_model={d_model} is not a whole number")
        mlp = int(ratio * d_model)
    vocab = whole(cfg, "vocab_size")
    eos = whole(cfg, "eos_token_id", minimum=0)
    return ModelConfig(
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=whole(cfg, "n_kv_heads", default=n_heads),
        n_layers=whole(cfg, "n_layers"),
        mlp_hidden_size=mlp,
        vocab_size=vocab,
        embedding_size=whole(cfg, "embedding_size", default=vocab),
        rope_theta=positive(cfg, "rope_theta", 10000.0),
        rms_norm_eps=positive(cfg, "rms_norm_eps", 1e-5),
        max_sequence_length=whole(cfg, "max_sequence_length", default=4096),
        mask_token_id=whole(cfg, "mask_token_id", minimum=0),
        eos_token_id=eos,
        pad_token_id=whole(cfg, "pad_token_id", default=eos, minimum=0),
        family="llada",
    )


def write(c: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": c.d_model,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads,
        "n_layers": c.n_layers,
        "mlp_hidden_size": c.mlp_hidden_size,
        "vocab_size": c.vocab_size,
        "embedding_size": c.embedding_size,
        "rope": True,
        "rope_theta": c.rope_theta,
        "rope_full_precision": True,
        "layer_norm_type": "rms",
        "rms_norm_eps": c.rms_norm_eps,
        "activation_type": "silu",
        "block_type": "llama",
        "max_sequence_length": c.max_sequence_length,
        "mask_token_id": c.mask_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        **{k: False for k in MUST_BE_FALSE if k not in ("clip_qkv",)},
        "layer_norm_with_affine": True,
    }


_LINEAR = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
_NORMS = ("attn_norm", "ff_norm")


def tensor_map(config: ModelConfig) -> dict[str, Target]:
    out = {
        "model.transformer.wte.weight": Target(("wte", "embedding"), None, False),
        "model.transformer.ln_f.weight": Target(("ln_f", "scale"), None, False),
        "model.transformer.ff_out.weight": Target(("ff_out", "kernel"), None, True),  # [V, D] -> [D, V]
    }
    for i in range(config.n_layers):
        block = f"model.transformer.blocks.{i}."
        out |= {f"{block}{k}.weight": Target(("blocks", k, "scale"), i, False) for k in _NORMS}
        out |= {f"{block}{k}.weight": Target(("blocks", k, "kernel"), i, True) for k in _LINEAR}
    return out


FAMILY = Family(
    name="llada", title="LLaDA", model_types=("llada",), architectures=("LLaDA",), key_hint="d_model",
    read=read, write=write, tensor_map=tensor_map, mask_token=MASK_TOKEN, chat_format="llada",
    likelihood="llada")
