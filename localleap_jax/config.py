"""`ModelConfig`: the LLaDA architecture read from a Hugging Face config.json.

LLaDA's config is OLMo-style (d_model, n_heads, mlp_hidden_size, ...). Only the
Llama-style block is implemented; any flag that would change the maths is
rejected by name instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config.json this package cannot run faithfully."""


# Flags that must be false/absent: each changes the network in a way model.py does not implement.
_MUST_BE_FALSE = (
    "alibi",
    "include_bias",
    "include_qkv_bias",
    "weight_tying",
    "attention_layer_norm",
    "scale_logits",
    "input_emb_norm",
    "multi_query_attention",
    "clip_qkv",
)
# Flags that must hold one specific value.
_MUST_EQUAL = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "rope": True,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int  # rows of wte and of the LM head (vocab padded up)
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081

    def __post_init__(self):
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size",
                     "vocab_size", "embedding_size", "max_sequence_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        if self.embedding_size < self.vocab_size:
            raise ConfigError(f"embedding_size={self.embedding_size} < vocab_size={self.vocab_size}")
        if not 0 <= self.mask_token_id < self.embedding_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} is outside the embedding")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_params(self) -> int:
        d, f, v = self.d_model, self.mlp_hidden_size, self.embedding_size
        kv = self.n_kv_heads * self.head_dim
        per_layer = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * f
        return 2 * v * d + d + self.n_layers * per_layer

    # ---- Hugging Face config.json <-> ModelConfig ----

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        bad = [k for k in _MUST_BE_FALSE if cfg.get(k)]
        bad += [f"{k}={cfg[k]!r} (only {v!r} is implemented)"
                for k, v in _MUST_EQUAL.items() if k in cfg and cfg[k] != v]
        if cfg.get("rope") is False:
            bad.append("rope=False (only RoPE is implemented)")
        if bad:
            raise ConfigError("config.json asks for features this model does not implement: "
                              + ", ".join(sorted(set(bad))))
        missing = [k for k in ("d_model", "n_heads", "n_layers") if k not in cfg]
        if missing:
            raise ConfigError(f"config.json is not a LLaDA config: missing {', '.join(missing)}")
        d_model, n_heads = int(cfg["d_model"]), int(cfg["n_heads"])
        if cfg.get("mlp_hidden_size"):
            mlp = int(cfg["mlp_hidden_size"])
        elif cfg.get("mlp_ratio"):
            mlp = int(cfg["mlp_ratio"] * d_model)
        else:
            raise ConfigError("config.json has neither mlp_hidden_size nor mlp_ratio")
        vocab = int(cfg["vocab_size"])
        eos = cfg.get("eos_token_id")
        pad = cfg.get("pad_token_id", eos)
        if "mask_token_id" not in cfg or eos is None:
            raise ConfigError("config.json must give mask_token_id and eos_token_id")
        return cls(
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("n_kv_heads") or n_heads),
            n_layers=int(cfg["n_layers"]),
            mlp_hidden_size=mlp,
            vocab_size=vocab,
            embedding_size=int(cfg.get("embedding_size") or vocab),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_sequence_length=int(cfg.get("max_sequence_length", 4096)),
            mask_token_id=int(cfg["mask_token_id"]),
            eos_token_id=int(eos),
            pad_token_id=int(pad if pad is not None else eos),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A LLaDA-style config.json for checkpoints this project writes itself."""
        return {
            "architectures": ["LLaDAModelLM"],
            "model_type": "llada",
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "n_layers": self.n_layers,
            "mlp_hidden_size": self.mlp_hidden_size,
            "vocab_size": self.vocab_size,
            "embedding_size": self.embedding_size,
            "rope": True,
            "rope_theta": self.rope_theta,
            "rope_full_precision": True,
            "layer_norm_type": "rms",
            "rms_norm_eps": self.rms_norm_eps,
            "activation_type": "silu",
            "block_type": "llama",
            "max_sequence_length": self.max_sequence_length,
            "mask_token_id": self.mask_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            **{k: False for k in _MUST_BE_FALSE if k not in ("clip_qkv",)},
        }

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(cfg)
