"""What the Qwen2/Qwen3-style families (Dream, SDAR, Fast-dLLM v2) share: their config.json keys, their tensor names
and their tokenizer (a Qwen2 byte-level BPE, released as a fast tokenizer.json, the slow files, or both).

Not a family: the family files read and write their own config.json with these pieces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from localleap_jax.config import ModelConfig
from localleap_jax.families.fields import positive, whole
from localleap_jax.families.target import Target

LINEAR = {  # HF module in a layer -> our block leaf
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",  # silu is applied to the gate
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm"}
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
HEAD_NORMS = {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}  # Qwen3: one RMSNorm scale of head_dim


def refusals(cfg: Mapping[str, Any], *, tied_ok: bool) -> list[str]:
    """What a Qwen2/Qwen3-style config.json may ask for that model.py does not implement."""
    bad = []
    if cfg.get("use_sliding_window"):
        bad.append("use_sliding_window=true (sliding-window attention is not implemented)")
    if cfg.get("rope_scaling") is not None:
        bad.append(f"rope_scaling={cfg['rope_scaling']!r} (only plain RoPE is implemented)")
    rope_parameters = cfg.get("rope_parameters")  # transformers >= 5 spelling of the same thing
    if isinstance(rope_parameters, Mapping) and rope_parameters.get("rope_type", "default") != "default":
        bad.append(f"rope_parameters={dict(rope_parameters)!r} (only plain RoPE is implemented)")
    if cfg.get("tie_word_embeddings") and not tied_ok:
        bad.append("tie_word_embeddings=true (a tied LM head is not implemented for this family)")
    if cfg.get("use_mrope"):
        bad.append("use_mrope=true (multimodal RoPE is not implemented)")
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu' is implemented)")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        bad.append(f"layer_types={sorted(set(layer_types))!r} (only full attention is implemented)")
    return bad


def fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a Qwen2/Qwen3-style config.json names alike."""
    d_model, n_heads = whole(cfg, "hidden_size"), whole(cfg, "num_attention_heads")
    vocab = whole(cfg, "vocab_size")
    eos = whole(cfg, "eos_token_id", minimum=0)
    return dict(
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=whole(cfg, "num_key_value_heads", default=n_heads),
        n_layers=whole(cfg, "num_hidden_layers"),
        mlp_hidden_size=whole(cfg, "intermediate_size"),
        vocab_size=vocab,
        embedding_size=vocab,  # as Qwen's: vocab_size counts every embedding row, the tokenizer knows fewer
        rope_theta=positive(cfg, "rope_theta", 10000.0),
        rms_norm_eps=positive(cfg, "rms_norm_eps", 1e-6),
        max_sequence_length=whole(cfg, "max_position_embeddings", default=32768),
        mask_token_id=whole(cfg, "mask_token_id", minimum=0),
        eos_token_id=eos,
        pad_token_id=whole(cfg, "pad_token_id", default=eos, minimum=0),
    )


def keys(c: ModelConfig) -> dict[str, Any]:
    """The config.json keys a Qwen2/Qwen3-style family writes alike."""
    return {
        "hidden_size": c.d_model,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "num_hidden_layers": c.n_layers,
        "intermediate_size": c.mlp_hidden_size,
        "vocab_size": c.embedding_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": c.max_sequence_length,
        "use_sliding_window": False,
        "mask_token_id": c.mask_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
    }


def tensor_map(config: ModelConfig) -> dict[str, Target]:
    """Qwen2/Qwen3's tensor names: `model.embed_tokens`, `model.layers.{i}.*`, `model.norm`, `lm_head` (absent when
    the head is tied); q/k/v biases with `config.qkv_bias`, per-head q/k norms with `config.qk_norm`."""
    out = {
        "model.embed_tokens.weight": Target(("wte", "embedding"), None, False),
        "model.norm.weight": Target(("ln_f", "scale"), None, False),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Target(("ff_out", "kernel"), None, True)  # [V, D] -> [D, V]
    norms = NORMS | (HEAD_NORMS if config.qk_norm else {})
    for i in range(config.n_layers):
        layer = f"model.layers.{i}."
        out |= {f"{layer}{hf}.weight": Target(("blocks", ours, "scale"), i, False) for hf, ours in norms.items()}
        out |= {f"{layer}{hf}.weight": Target(("blocks", ours, "kernel"), i, True) for hf, ours in LINEAR.items()}
        if config.qkv_bias:
            out |= {f"{layer}{hf}.bias": Target(("blocks", LINEAR[hf], "bias"), i, False) for hf in QKV}
    return out


SLOW_TOKENIZER_FILES = "the Qwen2 tokenizer's vocab.json + merges.txt"


def build_slow_tokenizer(src: Path, workdir: Path) -> bool:
    """tokenizer.json in `workdir` from the source's slow Qwen2 files, vocab.json + merges.txt + tokenizer_config.json
    (its added tokens and chat template), with transformers' own Qwen2 class: no remote code runs. False: the source
    has no such files."""
    if not ((src / "vocab.json").exists() and (src / "merges.txt").exists()):
        return False
    from localleap_jax.tokenizer import save_qwen2_fast_tokenizer

    save_qwen2_fast_tokenizer(src, workdir)
    return True
