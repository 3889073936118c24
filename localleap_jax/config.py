"""`ModelConfig`: the architecture read from a Hugging Face config.json, for either model family.

Three families share one network (a Llama-style block); their config.json files name things differently:
  llada  LLaDA's OLMo-style keys (d_model, n_heads, mlp_hidden_size, ...), no biases; bidirectional.
  dream  Dream's Qwen2-style keys (hidden_size, num_attention_heads, intermediate_size, ...),
         biases on q/k/v, and logits shifted by one position (see `ModelConfig.logits_shift`).
  sdar   SDAR / TraDo's Qwen3-style keys: per-head RMSNorm on q and k, head_dim from the config, an
         optionally tied head, and block-causal attention (`ModelConfig.block_size`): a block diffusion LM.
Any field that would change the maths in a way model.py does not implement is refused by name
instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

from localleap_jax.errors import ConfigError

FAMILIES = ("llada", "dream", "sdar")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int  # rows of the embedding and of the LM head (vocab padded up)
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    family: str = "llada"  # "llada" | "dream" | "sdar": how config.json and the tensors are named
    qkv_bias: bool = False  # q/k/v projections carry a bias (Dream, Qwen2-style)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, SDAR)
    explicit_head_dim: int | None = None  # head size when it is not d_model / n_heads (Qwen3's head_dim)
    tie_word_embeddings: bool = False  # the LM head is the embedding matrix (no separate ff_out)
    # 0: bidirectional attention. > 0: block-causal on each row's grid of this many positions (SDAR): a query
    # in block i sees keys in blocks <= i, so a finished block's K/V never change.
    block_size: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size",
                     "vocab_size", "embedding_size", "max_sequence_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.explicit_head_dim is not None and self.explicit_head_dim <= 0:
            raise ConfigError(f"head_dim must be positive, got {self.explicit_head_dim}")
        if self.block_size < 0:
            raise ConfigError(f"block_size must be >= 0 (0: bidirectional), got {self.block_size}")
        if (self.block_size > 0) != (self.family == "sdar"):
            raise ConfigError(f"block_size={self.block_size} with family {self.family!r}: only SDAR "
                              "(block diffusion) attends block-causally")
        if self.explicit_head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        if self.embedding_size < self.vocab_size:
            raise ConfigError(f"embedding_size={self.embedding_size} < vocab_size={self.vocab_size}")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name}={getattr(self, name)} is outside the vocabulary (vocab_size={self.vocab_size})")
        for name, why in (("eos_token_id", "a generated end of text would read as a position still to generate"),
                          ("pad_token_id", "padding would read as positions to generate")):
            if getattr(self, name) == self.mask_token_id:  # eos == pad is fine (LLaDA pads with EOS)
                raise ConfigError(f"{name}={getattr(self, name)} equals mask_token_id: {why}; the mask id must be a "
                                  "token of its own")
        if self.family == "dream" and self.vocab_size != self.embedding_size:
            # Dream's config.json has one vocab_size (the embedding rows); the tokenizer knows fewer ids.
            raise ConfigError(f"a Dream config has vocab_size == embedding_size, got {self.vocab_size} "
                              f"and {self.embedding_size}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def block_causal(self) -> bool:
        """A block diffusion LM: attention is causal across blocks of `block_size` and bidirectional inside one."""
        return self.block_size > 0

    @property
    def logits_shift(self) -> int:
        """How far the logits lag the tokens they score: 1 for Dream, which (trained from an
        autoregressive model) scores the token at i from the hidden state at i-1; 0 for LLaDA."""
        return 1 if self.family == "dream" else 0

    @property
    def num_params(self) -> int:
        d, f, v = self.d_model, self.mlp_hidden_size, self.embedding_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = (2 * d + 2 * d * q + 2 * d * kv + 3 * d * f + (q + 2 * kv if self.qkv_bias else 0)
                     + (2 * self.head_dim if self.qk_norm else 0))
        return (1 if self.tie_word_embeddings else 2) * v * d + d + self.n_layers * per_layer

    # ---- Hugging Face config.json <-> ModelConfig ----

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, not a {type(cfg).__name__}")
        return {"dream": _read_dream, "sdar": _read_sdar, "llada": _read_llada}[detect_family(cfg)](cfg)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json in the family's own layout, for checkpoints this project writes itself."""
        return {"dream": _write_dream, "sdar": _write_sdar, "llada": _write_llada}[self.family](self)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(cfg)


def detect_family(cfg: Mapping[str, Any]) -> str:
    """"llada", "dream" or "sdar", from config.json's model_type / architectures (key style as a last resort)."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    by_type = ({"llada": "llada", "dream": "dream", "sdar": "sdar"}.get(str(model_type).lower())
               if model_type is not None else None)
    if model_type is not None and by_type is None:
        raise ConfigError(f"config.json has model_type={model_type!r}; only LLaDA ('llada'), Dream ('Dream') and "
                          "SDAR/TraDo ('sdar') checkpoints are supported")
    arch_text = " ".join(map(str, archs)) if isinstance(archs, list) else str(archs)
    by_arch = ("dream" if "Dream" in arch_text else "llada" if "LLaDA" in arch_text
               else "sdar" if "SDAR" in arch_text else None)
    if by_type and by_arch and by_type != by_arch:
        raise ConfigError(f"config.json contradicts itself: model_type={model_type!r} but architectures={archs!r}")
    if by_type or by_arch:
        return by_type or by_arch
    if "d_model" in cfg:  # LLaDA configs written before model_type was required
        return "llada"
    raise ConfigError("config.json names no model family: expected model_type 'llada' (LLaDA), 'Dream' (Dream) "
                      "or 'sdar' (SDAR, TraDo)")


# ---------------------------------------------------------------- typed field readers
# JSON gives ints, floats, bools and null; a wrong type or range is named, never coerced
# (int(64.7) would silently build a different model).


def _int(cfg: Mapping, key: str, default: Any = None, minimum: int = 1) -> int:
    value = cfg.get(key)
    if value is None:  # absent or null: the family's default, if it has one
        value = default
    if value is None:
        raise ConfigError(f"config.json is missing {key}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json {key}={value!r} must be an integer")
    if value < minimum:
        raise ConfigError(f"config.json {key}={value} must be >= {minimum}")
    return value


def _positive_float(cfg: Mapping, key: str, default: float | None) -> float:
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(f"config.json is missing {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config.json {key}={value!r} must be a positive number")
    return float(value)


def _flag(cfg: Mapping, key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config.json {key}={value!r} must be true or false")
    return value


def _refuse(bad: list[str]) -> None:
    if bad:
        raise ConfigError("config.json asks for features this model does not implement: " + ", ".join(bad))


# ---------------------------------------------------------------- LLaDA (OLMo-style keys)

# Flags that must be false/absent: each changes the network in a way model.py does not implement.
_LLADA_MUST_BE_FALSE = (
    "alibi",
    "include_bias",
    "include_qkv_bias",
    "weight_tying",
    "attention_layer_norm",
    "scale_logits",
    "input_emb_norm",
    "multi_query_attention",
    "clip_qkv",
    "bias_for_layer_norm",
)
# Fields that must hold one specific value, and be present: LLaDA's own defaults for them
# (OLMo's: a sequential block, no RoPE, ...) describe a different network.
_LLADA_MUST_EQUAL = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "rope": True,
}
# Fields that may be absent but, when present, must hold this value.
_LLADA_IF_PRESENT = {
    "layer_norm_with_affine": True,  # false: RMSNorm without a scale
    "rope_full_precision": True,  # false: RoPE in the activation dtype; ours is always fp32
    "rope_scaling": None,  # not an OLMo field, but never silently ignored
}


def _read_llada(cfg: Mapping[str, Any]) -> ModelConfig:
    bad = [k for k in _LLADA_MUST_BE_FALSE if cfg.get(k)]
    bad += [(f"{k}={cfg[k]!r}" if k in cfg else f"{k} missing") + f" (only {v!r} is implemented)"
            for k, v in _LLADA_MUST_EQUAL.items() if cfg.get(k) != v]
    bad += [f"{k}={cfg[k]!r} (only {v!r} is implemented)" for k, v in _LLADA_IF_PRESENT.items()
            if k in cfg and cfg[k] != v]
    _refuse(sorted(bad))
    d_model = _int(cfg, "d_model")
    n_heads = _int(cfg, "n_heads")
    if cfg.get("mlp_hidden_size") is not None:
        mlp = _int(cfg, "mlp_hidden_size")
    elif cfg.get("mlp_ratio") is None:
        raise ConfigError("config.json has neither mlp_hidden_size nor mlp_ratio")
    else:
        ratio = _positive_float(cfg, "mlp_ratio", None)
        if not float(ratio * d_model).is_integer():
            raise ConfigError(f"config.json mlp_ratio={ratio} times d_model={d_model} is not a whole number")
        mlp = int(ratio * d_model)
    vocab = _int(cfg, "vocab_size")
    eos = _int(cfg, "eos_token_id", minimum=0)
    return ModelConfig(
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=_int(cfg, "n_kv_heads", default=n_heads),
        n_layers=_int(cfg, "n_layers"),
        mlp_hidden_size=mlp,
        vocab_size=vocab,
        embedding_size=_int(cfg, "embedding_size", default=vocab),
        rope_theta=_positive_float(cfg, "rope_theta", 10000.0),
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", 1e-5),
        max_sequence_length=_int(cfg, "max_sequence_length", default=4096),
        mask_token_id=_int(cfg, "mask_token_id", minimum=0),
        eos_token_id=eos,
        pad_token_id=_int(cfg, "pad_token_id", default=eos, minimum=0),
        family="llada",
    )


def _write_llada(c: ModelConfig) -> dict[str, Any]:
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
        **{k: False for k in _LLADA_MUST_BE_FALSE if k not in ("clip_qkv",)},
        "layer_norm_with_affine": True,
    }


# ---------------------------------------------------------------- Dream (Qwen2-style keys)
# Defaults are those of Dream's configuration_dream.py (used only when config.json omits a key).


def _qwen_refusals(cfg: Mapping[str, Any], *, tied_ok: bool) -> list[str]:
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


def _qwen_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a Qwen2/Qwen3-style config.json (Dream, SDAR) names alike."""
    d_model, n_heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    vocab = _int(cfg, "vocab_size")
    eos = _int(cfg, "eos_token_id", minimum=0)
    return dict(
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=_int(cfg, "num_key_value_heads", default=n_heads),
        n_layers=_int(cfg, "num_hidden_layers"),
        mlp_hidden_size=_int(cfg, "intermediate_size"),
        vocab_size=vocab,
        embedding_size=vocab,  # as Qwen's: vocab_size counts every embedding row, the tokenizer knows fewer
        rope_theta=_positive_float(cfg, "rope_theta", 10000.0),
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", 1e-6),
        max_sequence_length=_int(cfg, "max_position_embeddings", default=32768),
        mask_token_id=_int(cfg, "mask_token_id", minimum=0),
        eos_token_id=eos,
        pad_token_id=_int(cfg, "pad_token_id", default=eos, minimum=0),
    )


def _read_dream(cfg: Mapping[str, Any]) -> ModelConfig:
    _refuse(_qwen_refusals(cfg, tied_ok=False))

    fields = _qwen_fields(cfg)
    d_model, n_heads = fields["d_model"], fields["n_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != d_model // n_heads:
        _refuse([f"head_dim={head_dim!r} (only hidden_size / num_attention_heads = {d_model // n_heads})"])
    return ModelConfig(
        **fields,
        family="dream",
        # Dream's modeling code always builds q/k/v with biases; a config may say otherwise explicitly.
        qkv_bias=_flag(cfg, "attention_bias", True),
    )


def _qwen_keys(c: ModelConfig) -> dict[str, Any]:
    """The config.json keys a Qwen2/Qwen3-style family (Dream, SDAR) writes alike."""
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
    }


def _write_dream(c: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        **_qwen_keys(c),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "attention_bias": c.qkv_bias,
        "mask_token_id": c.mask_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
    }


# ---------------------------------------------------------------- SDAR / TraDo (Qwen3-style keys)
# Defaults are those of SDAR's configuration_sdar.py (used only when config.json omits a key).

# The block length SDAR's released chat models were trained with, for a config.json that does not say.
SDAR_DEFAULT_BLOCK_SIZE = 4


def _read_sdar(cfg: Mapping[str, Any]) -> ModelConfig:
    bad = _qwen_refusals(cfg, tied_ok=True)
    if cfg.get("attention_bias"):
        bad.append("attention_bias=true (Qwen3 then biases q/k/v and o; not implemented)")
    _refuse(bad)
    if cfg.get("mask_token_id") is None:
        raise ConfigError("config.json has no mask_token_id (SDAR's tokenizer names it <|MASK|>): convert the "
                          "checkpoint with `python -m convert SRC OUT`, which reads it from the tokenizer")
    fields = _qwen_fields(cfg)
    return ModelConfig(
        **fields,
        family="sdar",
        qk_norm=True,
        explicit_head_dim=_int(cfg, "head_dim", default=fields["d_model"] // fields["n_heads"]),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", False),
        block_size=_int(cfg, "block_size", default=SDAR_DEFAULT_BLOCK_SIZE),
    )


def _write_sdar(c: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        **_qwen_keys(c),
        "head_dim": c.head_dim,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
    }
