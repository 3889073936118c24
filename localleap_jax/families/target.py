"""Where each Hugging Face tensor of a family goes in the one Flax parameter tree.

A family's `tensor_map(config) -> {hf_name: Target | (Target, ...)}` is the complete set of tensors a checkpoint of
that family must hold, each with its destination: one leaf (slot), or, for a fused tensor (LLaDA2's
`query_key_value`, DiffusionGemma's stacked `gate_up_proj`), one Target per block of its rows (`rows`), which
together tile them. The converter checks a source against it and copies through it; `by_hf_name` runs it
backwards (Flax tree -> HF names) for the PyTorch references of tests and benchmarks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class Target(NamedTuple):
    """Where one HF tensor (or a block of its rows) goes: a leaf of the Flax tree, a slot of it (or None),
    transposed or not."""

    path: tuple[str, ...]
    layer: int | tuple[int, ...] | None  # the slot in a stacked leaf: its layer, or (layer, expert) for routed experts
    transpose: bool  # PyTorch Linear stores [out, in]; the Flax kernel is [in, out] (the last two axes swap)
    # [start, stop) of the HF tensor's rows, its second-to-last axis: the output features of a Linear weight
    # [out, in], or of a stack of expert weights [E, out, in] (None: all of it)
    rows: tuple[int, int] | None = None


def parts(entry: "Target | tuple[Target, ...]") -> tuple[Target, ...]:
    """The Targets of one tensor map entry (a tuple for a fused tensor)."""
    return entry if isinstance(entry, tuple) and not isinstance(entry, Target) else (entry,)


def _index(target: Target) -> tuple[int, ...]:
    return () if target.layer is None else target.layer if isinstance(target.layer, tuple) else (target.layer,)


def leaf_of(tree: Any, target: Target):
    """The array a Target names: its leaf, or the leaf's slot (its layer, or layer and expert)."""
    leaf = tree
    for k in target.path:
        leaf = leaf[k]
    index = _index(target)
    return leaf[index] if index else leaf


def hf_shape(target: Target, tree: Any) -> tuple[int, ...]:
    """The HF shape of what a Target holds (its rows' block, for a fused tensor), from the (abstract) tree: no
    indexing, so an abstract tree's ShapeDtypeStructs do."""
    leaf = tree
    for k in target.path:
        leaf = leaf[k]
    shape = tuple(leaf.shape)[len(_index(target)):]
    return shape[:-2] + (shape[-1], shape[-2]) if target.transpose else shape


def swap_last(arr):
    """An array with its last two axes swapped (a Linear weight [out, in] <-> a kernel [in, out], per expert)."""
    return np.swapaxes(arr, -1, -2) if isinstance(arr, np.ndarray) else arr.swapaxes(-1, -2)


def by_hf_name(params: Any, tensor_map: dict) -> dict[str, Any]:
    """HF-named tensors ([out, in] like PyTorch) from a Flax tree; a fused tensor's blocks are concatenated in row
    order. Arrays stay whatever type the tree holds."""
    out = {}
    for name, entry in tensor_map.items():
        blocks = []
        for tgt in sorted(parts(entry), key=lambda t: (t.rows or (0, 0))[0]):
            arr = leaf_of(params, tgt)
            blocks.append(swap_last(arr) if tgt.transpose else arr)
        out[name] = blocks[0] if len(blocks) == 1 else np.concatenate([np.asarray(b) for b in blocks], axis=-2)
    return out
