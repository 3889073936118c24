"""Where each Hugging Face tensor of a model family goes in the one Flax parameter tree.

Every family module has `tensor_map(config) -> {hf_name: Target}`: the complete set of tensors a
checkpoint of that family must hold, each with its destination. The converter checks a source
against it and copies through it; `hf_tensors` runs it backwards (Flax tree -> HF names) for the
PyTorch reference models of tests and benchmarks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from localleap_jax.config import ModelConfig


class Target(NamedTuple):
    """Where one HF tensor goes: a leaf of the Flax tree, a layer slot (or None), transposed or not."""

    path: tuple[str, ...]
    layer: int | None
    transpose: bool  # PyTorch Linear stores [out, in]; the Flax kernel is [in, out]


# The family modules import `Target` from here, so they are imported after it is defined.
from localleap_jax.families import dream, llada, sdar  # noqa: E402

_TENSOR_MAPS = {"llada": llada.tensor_map, "dream": dream.tensor_map, "sdar": sdar.tensor_map}


def tensor_map(config: ModelConfig) -> dict[str, Target]:
    """Every HF tensor name of `config.family`'s checkpoints, with its destination in the tree."""
    return _TENSOR_MAPS[config.family](config)


def hf_tensors(params: Any, config: ModelConfig) -> dict[str, Any]:
    """The family's HF-named tensors ([out, in] like PyTorch) from a Flax tree. Arrays stay whatever
    type the tree holds (numpy, jax)."""
    out = {}
    for name, tgt in tensor_map(config).items():
        leaf = params
        for k in tgt.path:
            leaf = leaf[k]
        arr = leaf if tgt.layer is None else leaf[tgt.layer]
        out[name] = arr.T if tgt.transpose else arr
    return out
