"""Dream's tensor names (Qwen2 layout): `model.embed_tokens`, `model.layers.{i}.*`, `model.norm`,
`lm_head`.

Biases on q/k/v only (when `config.qkv_bias`, as in Dream-7B); the LM head is untied. Each HF
module maps onto the leaf of the same role in the shared tree (LLaDA's names).
"""

from __future__ import annotations

from localleap_jax.config import ModelConfig
from localleap_jax.families import Target

_LINEAR = {  # HF module in a layer -> our block leaf
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",  # silu is applied to the gate
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm"}
_BIASED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def tensor_map(config: ModelConfig) -> dict[str, Target]:
    out = {
        "model.embed_tokens.weight": Target(("wte", "embedding"), None, False),
        "model.norm.weight": Target(("ln_f", "scale"), None, False),
        "lm_head.weight": Target(("ff_out", "kernel"), None, True),  # [V, D] -> [D, V]
    }
    for i in range(config.n_layers):
        layer = f"model.layers.{i}."
        out |= {f"{layer}{hf}.weight": Target(("blocks", ours, "scale"), i, False) for hf, ours in _NORMS.items()}
        out |= {f"{layer}{hf}.weight": Target(("blocks", ours, "kernel"), i, True) for hf, ours in _LINEAR.items()}
        if config.qkv_bias:
            out |= {f"{layer}{hf}.bias": Target(("blocks", _LINEAR[hf], "bias"), i, False) for hf in _BIASED}
    return out
