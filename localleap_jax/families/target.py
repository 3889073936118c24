"""Where each Hugging Face tensor of a family goes in the one Flax parameter tree.

A family's `tensor_map(config) -> {hf_name: Target}` is the complete set of tensors a checkpoint of that family
must hold, each with its destination. The converter checks a source against it and copies through it;
`by_hf_name` runs it backwards (Flax tree -> HF names) for the PyTorch references of tests and benchmarks.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Target(NamedTuple):
    """Where one HF tensor goes: a leaf of the Flax tree, a layer slot (or None), transposed or not."""

    path: tuple[str, ...]
    layer: int | None
    transpose: bool  # PyTorch Linear stores [out, in]; the Flax kernel is [in, out]


def by_hf_name(params: Any, tensor_map: dict[str, Target]) -> dict[str, Any]:
    """HF-named tensors ([out, in] like PyTorch) from a Flax tree. Arrays stay whatever type the tree holds."""
    out = {}
    for name, tgt in tensor_map.items():
        leaf = params
        for k in tgt.path:
            leaf = leaf[k]
        arr = leaf if tgt.layer is None else leaf[tgt.layer]
        out[name] = arr.T if tgt.transpose else arr
    return out
