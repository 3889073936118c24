"""The host side of `ll.loglikelihood`: check the requests, give each its key, group them by length, run one
compiled program per group shape, return the estimates in request order.

    estimates = loglikelihood(model, contexts, continuations, LikelihoodConfig(), placement=OnOneDevice())

Groups: requests are sorted by (window, length) and cut into groups of `requests_per_call`; a group's canvas
T and window C are rounded up to a few sizes per octave (`length_bucket`; powers of two for C), so an
evaluation compiles a handful of programs (`compiled_programs()` lists them, kind "likelihood").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from localleap_jax.compile_cache import compile_once, signature
from localleap_jax.families import family_of
from localleap_jax.likelihood.config import LikelihoodConfig, LikelihoodError
from localleap_jax.likelihood.estimators import estimator_for
from localleap_jax.likelihood.program import Requests, greedy_suffix, mc_loglikelihood


def length_bucket(n: int) -> int:
    """n rounded up to a multiple of 16 up to 64, then to a quarter of its octave (at most 19% padding)."""
    if n <= 64:
        return max(16, -(-n // 16) * 16)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def window_bucket(n: int) -> int:
    """The continuation window: the next power of two >= n, at least 8 (a wider window costs little: fewer programs)."""
    return max(8, 1 << max(n - 1, 0).bit_length())


def _as_id_list(value, what: str, index: int, vocab: int, empty_ok: bool, mask_id: int | None = None) -> list[int]:
    if isinstance(value, (str, bytes)) or value is None:
        raise LikelihoodError(f"request {index}: the {what} must be a list of token ids, got {type(value).__name__} "
                              "(encode text with likelihood.encode_pair)")
    try:
        ids = np.asarray(value)
    except Exception:
        raise LikelihoodError(f"request {index}: the {what} is not a list of token ids") from None
    if ids.size == 0:
        if not empty_ok:
            raise LikelihoodError(f"request {index}: the {what} is empty (nothing to score)")
        return []
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise LikelihoodError(f"request {index}: the {what} must be a flat list of integer token ids "
                              f"(got shape {ids.shape}, dtype {ids.dtype})")
    if ids.min() < 0 or ids.max() >= vocab:
        raise LikelihoodError(f"request {index}: the {what} holds ids outside [0, {vocab})")
    if mask_id is not None and (ids == mask_id).any():
        raise LikelihoodError(f"request {index}: the {what} holds the mask id ({mask_id}): it would read as a "
                              "position to predict")
    return ids.astype(np.int64).tolist()


def check_requests(contexts, continuations, config) -> list[tuple[list[int], list[int]]]:
    """The (context, continuation) id lists, or one LikelihoodError naming the first bad request."""
    if any(isinstance(a, (str, bytes)) or not hasattr(a, "__iter__") for a in (contexts, continuations)):
        raise LikelihoodError("contexts and continuations are lists of token-id lists, one per request")
    contexts, continuations = list(contexts), list(continuations)
    if len(contexts) != len(continuations):
        raise LikelihoodError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    pairs = []
    for i, (context, continuation) in enumerate(zip(contexts, continuations)):
        pair = (_as_id_list(context, "context", i, config.embedding_size, empty_ok=True, mask_id=config.mask_token_id),
                _as_id_list(continuation, "continuation", i, config.embedding_size, empty_ok=False,
                            mask_id=config.mask_token_id))
        total = len(pair[0]) + len(pair[1])
        if total > config.max_sequence_length:
            raise LikelihoodError(f"request {i}: context + continuation ({total} tokens) exceed the model's "
                                  f"max_sequence_length ({config.max_sequence_length})")
        if config.logits_shift and not pair[0] and len(pair[1]) < 2:
            raise LikelihoodError(f"request {i}: a one-token continuation with no context has nothing to be "
                                  "scored from (this family predicts token i from position i - 1)")
        pairs.append(pair)
    return pairs


def request_hash(context: Sequence[int], continuation: Sequence[int]) -> int:
    """A 32-bit digest of the request's ids (what its key is folded with: the same request, the same noise)."""
    data = np.asarray([len(context), *context, *continuation], np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:4], "little")


class Placement(Protocol):
    """Where a group runs: one device here, a (data, model) mesh in `localleap_jax.dist.mesh`."""

    kind: str

    def rows(self, requests: int) -> int: ...

    def place(self, denoiser, requests: Requests) -> tuple[Any, Requests]: ...

    def fetch(self, out: jax.Array, rows: int) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class OnOneDevice:
    kind = "likelihood"

    def rows(self, requests):
        return requests

    def place(self, denoiser, requests):
        return denoiser, requests

    def fetch(self, out, rows):
        return np.asarray(out)[:rows]


@dataclasses.dataclass
class Groups:
    """Requests in groups of one shape: each group's request indices, canvas T and window C."""

    members: list[list[int]]
    shapes: list[tuple[int, int]]


def make_groups(pairs, size: int, shift: int) -> Groups:
    """Consecutive runs of `size` requests in (window, length) order; a group's window is its longest
    continuation's bucket and its canvas its longest request's (plus the shift's one position)."""
    order = sorted(range(len(pairs)), key=lambda i: (window_bucket(len(pairs[i][1])),
                                                     len(pairs[i][0]) + len(pairs[i][1]), i))
    members = [order[start:start + size] for start in range(0, len(order), size)]
    shapes = []
    for group in members:
        C = window_bucket(max(len(pairs[i][1]) for i in group))
        longest = max(len(pairs[i][0]) + len(pairs[i][1]) for i in group)
        shapes.append((length_bucket(max(longest, C) + shift), C))
    return Groups(members, shapes)


def _group_arrays(pairs, group: list[int], rows: int, T: int, pad_id: int):
    """Left-padded canvases of one group (filled up to `rows` with copies of its last request), and which
    request each row holds."""
    filled = group + [group[-1]] * (rows - len(group))
    ids = np.full((rows, T), pad_id, np.int32)
    mask = np.zeros((rows, T), bool)
    length = np.zeros((rows,), np.int32)
    for r, i in enumerate(filled):
        seq = pairs[i][0] + pairs[i][1]
        ids[r, T - len(seq):] = seq
        mask[r, T - len(seq):] = True
        length[r] = len(pairs[i][1])
    return ids, mask, length, filled


def _program(kind: str, denoiser, requests: Requests, cfg_scale, placement: Placement, fn: Callable, static: tuple):
    key = (placement, kind, static, signature(denoiser), signature(requests))  # a mesh placement: its mesh too
    lower = lambda: jax.jit(fn).lower(denoiser, requests, cfg_scale)  # noqa: E731
    return compile_once(f"{placement.kind}/{kind}", key, lower,
                        shapes=tuple(np.shape(a) for a in jax.tree.leaves(requests)))


def run_groups(model, contexts, continuations, lcfg: LikelihoodConfig, *, placement: Placement | None = None,
               greedy: bool = False, on_group: Callable | None = None) -> np.ndarray:
    """Estimates [N] (float64; with `greedy`, LLaDA's greedy-suffix flags [N] bool instead), in request order.
    `on_group(indices, values, seconds)` after each group (a progress bar, a stats log)."""
    placement = placement or OnOneDevice()
    if not isinstance(lcfg, LikelihoodConfig):
        raise LikelihoodError(f"the likelihood settings must be an ll.LikelihoodConfig, got {type(lcfg).__name__}")
    lcfg = lcfg.validate()
    config = model.config
    family = family_of(config)
    if family.likelihood is None:
        raise LikelihoodError(family.likelihood_refusal or f"likelihood of {family.title} models is not served")
    if lcfg.estimator == "dream" and not family.pairs_end_with_eos:
        raise LikelihoodError(f"estimator='dream' never scores a continuation's last token (the EOS Dream's pairs end "
                              f"with); pairs of this {family.title} model hold none: use its own estimator")
    pairs = check_requests(contexts, continuations, config)
    out = np.zeros((len(pairs),), bool if greedy else np.float64)
    if not pairs:
        return out
    estimator = estimator_for(lcfg.estimator or family.likelihood, lcfg.sampling_eps)
    hashes = np.asarray([request_hash(*p) for p in pairs], np.uint32)
    seed_key = jax.random.key(lcfg.seed)
    request_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(seed_key, jnp.asarray(hashes))
    key_data = np.asarray(jax.random.key_data(request_keys))
    guided = lcfg.cfg_scale > 0
    cfg_scale = jnp.float32(lcfg.cfg_scale)
    groups = make_groups(pairs, lcfg.requests_per_call, config.logits_shift)
    mask_id, pad_id = config.mask_token_id, config.pad_token_id
    for group, (T, C) in zip(groups.members, groups.shapes):
        rows = placement.rows(lcfg.requests_per_call)
        ids, mask, length, filled = _group_arrays(pairs, group, rows, T, pad_id)
        keys = jax.random.wrap_key_data(key_data[filled])
        denoiser, requests = placement.place(model.denoiser, Requests(ids, mask, length, keys))
        if greedy:
            fn = functools.partial(greedy_suffix, mask_id=mask_id, window=C, guided=guided)
            static = ("greedy", mask_id, C, guided)
        else:
            fn = functools.partial(mc_loglikelihood, estimator=estimator, mask_id=mask_id,
                                   batch_size=lcfg.batch_size, mc_batches=lcfg.mc_batches, window=C, guided=guided)
            static = ("mc", estimator, mask_id, lcfg.batch_size, lcfg.mc_batches, C, guided)
        compiled, _ = _program("greedy" if greedy else "mc", denoiser, requests, cfg_scale, placement, fn, static)
        t0 = time.perf_counter()
        values = placement.fetch(compiled(denoiser, requests, cfg_scale), rows)[:len(group)]
        seconds = time.perf_counter() - t0
        out[group] = values
        if on_group is not None:
            on_group(group, values, seconds)
    return out
