"""LLaDA's tensor names (OLMo layout): `model.transformer.{wte, blocks.{i}.*, ln_f, ff_out}.weight`.

No biases; the LM head (`ff_out`) is untied. MLP: ff_out(silu(ff_proj x) * up_proj x).
"""

from __future__ import annotations

from localleap_jax.config import ModelConfig
from localleap_jax.families import Target

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
