"""SDAR / TraDo's tensor names (Qwen3 layout): `model.embed_tokens`, `model.layers.{i}.*` (with
`self_attn.q_norm` / `self_attn.k_norm`, one RMSNorm scale of head_dim each), `model.norm`, `lm_head`.

No biases. A tied checkpoint (`tie_word_embeddings`) has no `lm_head.weight`: the embedding is the head.
"""

from __future__ import annotations

from localleap_jax.config import ModelConfig
from localleap_jax.families import Target
from localleap_jax.families.dream import _LINEAR, _NORMS

_HEAD_NORMS = {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}


def tensor_map(config: ModelConfig) -> dict[str, Target]:
    out = {
        "model.embed_tokens.weight": Target(("wte", "embedding"), None, False),
        "model.norm.weight": Target(("ln_f", "scale"), None, False),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Target(("ff_out", "kernel"), None, True)  # [V, D] -> [D, V]
    for i in range(config.n_layers):
        layer = f"model.layers.{i}."
        norms = _NORMS | _HEAD_NORMS
        out |= {f"{layer}{hf}.weight": Target(("blocks", ours, "scale"), i, False) for hf, ours in norms.items()}
        out |= {f"{layer}{hf}.weight": Target(("blocks", ours, "kernel"), i, True) for hf, ours in _LINEAR.items()}
    return out
