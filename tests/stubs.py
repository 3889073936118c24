"""A weightless stand-in for the model: scripted predictions and confidences per generated position.

`scripted(target, conf)` returns a model whose denoiser predicts target[b, j] at generated position j
with probability conf[b, j] (the rest spread evenly), whatever the canvas holds; `depends_on_canvas`
variants make the confidence grow with committed neighbours, so a step changes the next one. The
decode loop runs on it in milliseconds, with no torch and no checkpoint.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from localleap_jax.config import ModelConfig
from localleap_jax.denoiser import FunctionDenoiser, SpecialIds

EOS, WORD, MASK, V = 0, 1, 7, 8  # ids 1..6 are words


class StubModel(NamedTuple):
    """What `ll.generate` needs of a model: its config, the denoiser the loop runs and the special ids."""

    config: ModelConfig
    denoiser: Any

    @property
    def special(self) -> SpecialIds:
        return SpecialIds.of(self.config)


def config(max_sequence_length: int = 512) -> ModelConfig:
    return ModelConfig(d_model=8, n_heads=1, n_kv_heads=1, n_layers=1, mlp_hidden_size=8, vocab_size=V,
                       embedding_size=V, max_sequence_length=max_sequence_length, mask_token_id=MASK,
                       eos_token_id=EOS, pad_token_id=EOS)


def log_probs(target, conf) -> np.ndarray:
    """[..., V] log-probabilities putting `conf` on `target` and the rest evenly on the other ids."""
    target, conf = np.asarray(target), np.asarray(conf, np.float64)
    rest = np.log((1.0 - conf) / (V - 1))[..., None]
    out = np.broadcast_to(rest, conf.shape + (V,)).copy()
    np.put_along_axis(out, target[..., None], np.log(conf)[..., None], axis=-1)
    return out.astype(np.float32)


def scripted(target, conf, *, neighbour_bonus: float = 0.0, shift: int = 0) -> StubModel:
    """A stub whose generated position j (of G = target.shape[1]) predicts target[b, j] with confidence
    conf[b, j], plus `neighbour_bonus` per already-committed neighbour at distance 1 (capped below 1)."""
    target = jnp.asarray(np.asarray(target, np.int32))
    base = jnp.asarray(np.asarray(conf, np.float32))
    G = target.shape[1]

    def logits_fn(x):
        B, L = x.shape
        gen = x[:, L - G:]
        done = (gen != MASK).astype(jnp.float32)
        neighbours = jnp.pad(done, ((0, 0), (1, 0)))[:, :-1] + jnp.pad(done, ((0, 0), (0, 1)))[:, 1:]
        c = jnp.minimum(base + neighbour_bonus * neighbours, 0.99)
        rest = jnp.log((1.0 - c) / (V - 1))[..., None]
        lp = jnp.where(jnp.arange(V) == target[..., None], jnp.log(c)[..., None], rest)
        if shift:  # the hidden state at i - 1 scores position i: position P + j's scores sit at P + j - 1
            return jnp.concatenate([jnp.zeros((B, L - G - 1, V)), lp, jnp.zeros((B, 1, V))], axis=1)
        return jnp.concatenate([jnp.zeros((B, L - G, V)), lp], axis=1)

    return StubModel(config(), FunctionDenoiser(logits_fn, V, shift))


def prompts(batch: int, length: int = 3) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((batch, length), WORD + 1, np.int32)
    return ids, np.ones_like(ids, bool)


def seeded(gen_length: int) -> StubModel:
    """A stub whose predictions and confidences at generated position j depend only on the row's own canvas: a seed
    from its prompt tokens, j, and how many positions it has committed. So a row decodes the same alone or in any
    batch (rows differ in their prompts), and its confidences move as it commits."""
    G = gen_length

    def logits_fn(x):
        B, L = x.shape
        P = L - G
        seed = jnp.sum(jnp.where(x[:, :P] == EOS, 0, x[:, :P] * (jnp.arange(P) % 5 + 1)), axis=1) % 97
        committed = jnp.sum(x[:, P:] != MASK, axis=1)
        j = jnp.arange(G)
        c = 0.25 + 0.74 * ((seed[:, None] * 0.3719 + j[None] * 0.6180 + committed[:, None] * 0.1377) % 1.0)
        target = ((seed[:, None] + j[None] * 3 + committed[:, None] // 5) % 6 + 1).astype(jnp.int32)
        rest = jnp.log((1.0 - c) / (V - 1))[..., None]
        lp = jnp.where(jnp.arange(V) == target[..., None], jnp.log(c)[..., None], rest)
        return jnp.concatenate([jnp.zeros((B, P, V)), lp], axis=1)

    return StubModel(config(), FunctionDenoiser(logits_fn, V, 0))


def ragged_prompts(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n left-padded prompts of 2 to 8 word ids each."""
    rs = np.random.default_rng(seed)
    lengths = rs.integers(2, 9, n)
    ids = np.full((n, lengths.max()), EOS, np.int32)
    mask = np.zeros(ids.shape, bool)
    for i, k in enumerate(lengths):
        ids[i, ids.shape[1] - k:] = rs.integers(1, 7, k)
        mask[i, ids.shape[1] - k:] = True
    return ids, mask
