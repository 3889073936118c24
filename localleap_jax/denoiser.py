"""The model as the decode loop sees it: a denoiser (a canvas to hidden states and logits) and its special ids.

The loop is given these two things explicitly instead of reaching into a model, so its bookkeeping
(blocks, early stop, NFE, rule state, caches) can be tested with a stub in milliseconds, and another
model family only has to provide a denoiser:

    full(x, positions, key_mask, soft=None)          -> (hidden [B, L, D], cache)   a whole-canvas pass
    window(tokens, positions, key_mask, cache, write, soft=None)
                                                      -> hidden [B, Q, D]           Q positions of the
                                                         canvas, other positions' K/V read from `cache`
    window_stored(...same...)                         -> (hidden, cache with the window's fresh K/V)
    (`soft` [B, Q, D]: an addition to the token embeddings of the positions run, or None)
    head(hidden)                                      -> logits [..., V] (fp32)
    empty_cache(batch, length)                        -> the cache's initial value
    soft_embedding(logits [B, Q, V])                  -> [B, Q, D] softmax(logits) @ E: the embedding a distribution
                                                         expects (dInfer's iteration smoothing feeds it back as `soft`)
    no_soft(batch, length)                            -> zeros [B, length, D] (no soft input), the embedding's dtype
    probe(x, positions, key_mask, idx, mask_id)       -> (hidden [B, L, D], held_out [B, T, D]): a whole-canvas
                                                         pass that also scores positions idx [B, T] each with
                                                         itself hidden, in the same forward pass (WINO)

`shift` is 1 when position i is predicted from the hidden state at i - 1 (Dream), else 0. A denoiser
is a pytree (its arrays are inputs of the compiled program, not constants baked into it).

A uniform-noise canvas model (DiffusionGemma) is a `CanvasDenoiser` instead: an encoder into a K/V cache and a
decoder over one canvas (decoded by a canvas rule, with the loop's encoder cache policy).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Protocol

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.config import ModelConfig
from localleap_jax.model import (CacheWrite, KVCache, Params, decoding_params, head, trunk, trunk_cached,
                                 trunk_masked, trunk_stored)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The ids the loop treats specially, read from the model's config and tokenizer (never hard-coded)."""

    mask: int
    eos: int
    eot: int | None  # end of turn (LLaDA <|eot_id|>, Dream <|im_end|>); None when the tokenizer has none
    vocab_limit: int | None = None  # ids >= this are never predicted (the tokenizer cannot decode them)
    delete: int | None = None  # LLaDA2.2's edit tokens (config.json), which its insert/delete decoder writes
    split: int | None = None

    @classmethod
    def of(cls, config: ModelConfig, tokenizer=None) -> "SpecialIds":
        """A model's special ids: mask, EOS and the edit tokens from its config, EOT and the decodable ids from its
        tokenizer."""
        edit = (config.delete_token_id, config.split_token_id)
        if tokenizer is None:
            return cls(config.mask_token_id, config.eos_token_id, None, None, *edit)
        return cls(config.mask_token_id, config.eos_token_id, tokenizer.eot_id, tokenizer.vocab_size, *edit)


class Denoiser(Protocol):
    shift: int
    vocab: int
    lanes: bool  # a pass may run some rows of the batch apart, gathered (False: rows are tied to their place)

    def full(self, x: Int[Array, "B L"], positions: Int[Array, "B L"], key_mask: Bool[Array, "B L"],
             soft: Float[Array, "B L D"] | None = None) -> tuple[Float[Array, "B L D"], Any]: ...

    def window(self, tokens: Int[Array, "B Q"], positions: Int[Array, "B Q"], key_mask: Bool[Array, "B L"],
               cache: Any, write: CacheWrite, soft: Float[Array, "B Q D"] | None = None) -> Float[Array, "B Q D"]: ...

    def window_stored(self, tokens: Int[Array, "B Q"], positions: Int[Array, "B Q"], key_mask: Bool[Array, "B L"],
                      cache: Any, write: CacheWrite, soft: Float[Array, "B Q D"] | None = None
                      ) -> tuple[Float[Array, "B Q D"], Any]: ...

    def head(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]: ...

    def empty_cache(self, batch: int, length: int) -> Any: ...

    def soft_embedding(self, logits: Float[Array, "B Q V"]) -> Float[Array, "B Q D"]: ...

    def no_soft(self, batch: int, length: int) -> Float[Array, "B Q D"]: ...

    def probe(self, x: Int[Array, "B L"], positions: Int[Array, "B L"], key_mask: Bool[Array, "B L"],
              idx: Int[Array, "B T"], mask_id: int) -> tuple[Float[Array, "B L D"], Float[Array, "B T D"]]: ...


class CanvasDenoiser(Protocol):
    """A uniform-noise canvas model as the decode loop sees it (DiffusionGemma: `families/diffusion_gemma.py`): an
    encoder that appends finished text to a static-shape K/V cache, a decoder that denoises a canvas after what the
    cache holds, and the self-conditioning input that carries one pass's distribution to the next.

        cache = empty_cache(batch, length)
        cache = encode(cache, ids [B, T], mask [B, T], rows [B] | None)   # T more slots per row (rows: only those)
        cache = restart(cache, rows)                                        # rows emptied (a slot's next prompt)
        hidden = decode(cache, canvas [B, C], soft [B, C, D])               # soft: no_soft(B, C) on a first pass
        logits = head(hidden)                                               # [B, C, V] fp32
        soft = soft_embedding(scaled_logits [B, C, V])                      # the next pass's self-conditioning
        check_prompt(ids)                                                   # refuse on the host what it cannot take
    """

    shift: int
    vocab: int  # uniform draws are ids in [0, vocab)

    def empty_cache(self, batch: int, length: int) -> Any: ...

    def encode(self, cache: Any, ids: Int[Array, "B T"], mask: Bool[Array, "B T"],
               rows: Bool[Array, "B"] | None = None) -> Any: ...

    def restart(self, cache: Any, rows: Bool[Array, "B"]) -> Any: ...

    def decode(self, cache: Any, canvas: Int[Array, "B C"], soft: Float[Array, "B C D"]) -> Float[Array, "B C D"]: ...

    def head(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]: ...

    def soft_embedding(self, z: Float[Array, "B C V"]) -> Float[Array, "B C D"]: ...

    def no_soft(self, batch: int, length: int) -> Float[Array, "B C D"]: ...

    def check_prompt(self, ids) -> None: ...


def probe_mask(key_mask: Bool[Array, "B L"], idx: Int[Array, "B T"]) -> Bool[Array, "B L+T L+T"]:
    """Attention (query sees key) of a canvas extended by a probe copy of positions idx: the canvas sees its own
    real keys, never the copy; copy position j sees every real key but position idx[j], and the whole copy
    (WINO's verification mask: the copy holds only masks, so seeing it tells a copy query nothing)."""
    B, L = key_mask.shape
    T = idx.shape[1]
    canvas_rows = jnp.concatenate([jnp.broadcast_to(key_mask[:, None, :], (B, L, L)), jnp.zeros((B, L, T), bool)],
                                  axis=2)
    own = jnp.arange(L)[None, None, :] == idx[:, :, None]  # [B, T, L]
    copy_rows = jnp.concatenate([key_mask[:, None, :] & ~own, jnp.ones((B, T, T), bool)], axis=2)
    return jnp.concatenate([canvas_rows, copy_rows], axis=1)


@struct.dataclass
class ModelDenoiser:
    """A parameter tree of model.py's network (decoding layout: `model.decoding_params`) and its config."""

    params: Params
    config: ModelConfig = struct.field(pytree_node=False)
    lanes: ClassVar[bool] = True

    @classmethod
    def of(cls, params: Params, config: ModelConfig) -> "ModelDenoiser":
        """The denoiser of parameters in either layout (a stacked tree is split here, once)."""
        return cls(decoding_params(params, config), config)

    @property
    def shift(self) -> int:
        return self.config.logits_shift

    @property
    def vocab(self) -> int:
        return self.config.embedding_size

    def full(self, x, positions, key_mask, soft=None):
        return trunk(self.params, x, positions, key_mask, self.config, soft)

    def window(self, tokens, positions, key_mask, cache, write, soft=None):
        return trunk_cached(self.params, tokens, positions, key_mask, cache, write, self.config, soft)

    def window_stored(self, tokens, positions, key_mask, cache, write, soft=None):
        return trunk_stored(self.params, tokens, positions, key_mask, cache, write, self.config, soft)

    def head(self, hidden):
        return head(self.params, hidden, self.config)

    def probe(self, x, positions, key_mask, idx, mask_id):
        # One pass over [canvas | copy]: the copy holds masks at the probed positions' RoPE positions.
        B, L = x.shape
        T = idx.shape[1]
        tokens = jnp.concatenate([x, jnp.full((B, T), mask_id, x.dtype)], axis=1)
        at = jnp.concatenate([positions, jnp.take_along_axis(positions, idx, axis=1)], axis=1)
        h = trunk_masked(self.params, tokens, at, probe_mask(key_mask, idx), self.config)
        return h[:, :L], h[:, L:]

    def empty_cache(self, batch, length):
        c = self.config
        shape = (batch, c.n_kv_heads, length, c.head_dim)  # model.KVCache: heads first
        dtype = self.params["wte"]["embedding"].dtype
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(c.n_layers))
        return KVCache(zeros, zeros)

    def soft_embedding(self, logits):
        # dInfer's H2Embed at tau 1: the softmax in fp32, the product with the table accumulated in fp32
        table = self.params["wte"]["embedding"]
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(table.dtype)
        return jnp.einsum("bqv,vd->bqd", probs, table, preferred_element_type=jnp.float32).astype(table.dtype)

    def no_soft(self, batch, length):
        return jnp.zeros((batch, length, self.config.d_model), self.params["wte"]["embedding"].dtype)


@struct.dataclass
class FunctionDenoiser:
    """A stub: `logits_fn(canvas [B, L]) -> logits [B, L, V]` stands in for the whole model.

    Its hidden states are the logits themselves (the head is the identity), and its "cache" is the
    canvas as it was at the last full pass: a windowed pass sees this step's tokens at the window's
    fresh positions and the cached canvas everywhere else, which is exactly what a K/V cache
    approximates. Use it to test rules and the loop without weights."""

    logits_fn: Callable = struct.field(pytree_node=False)
    vocab: int = struct.field(pytree_node=False)
    shift: int = struct.field(pytree_node=False, default=0)
    lanes: ClassVar[bool] = False  # logits_fn may script each row by its place in the batch

    def full(self, x, positions, key_mask, soft=None):  # the stub's "embedding" is the identity: soft adds to logits
        logits = self.logits_fn(x).astype(jnp.float32)
        return (logits if soft is None else logits + soft), x

    def window(self, tokens, positions, key_mask, cache, write, soft=None):
        return self.window_stored(tokens, positions, key_mask, cache, write, soft)[0]

    def window_stored(self, tokens, positions, key_mask, cache, write, soft=None):
        Q = tokens.shape[1]
        at = write.start[:, None] + jnp.arange(Q)
        rows = jnp.arange(tokens.shape[0])[:, None]
        seen = cache.at[rows, at].set(jnp.where(write.fresh, tokens, cache[rows, at]))
        logits = self.logits_fn(seen).astype(jnp.float32)[rows, at]
        return (logits if soft is None else logits + soft), seen

    def head(self, hidden):
        return hidden

    def empty_cache(self, batch, length):
        return jnp.zeros((batch, length), jnp.int32)

    def soft_embedding(self, logits):  # the stub's hidden states are logits: its embedding table is the identity
        return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

    def no_soft(self, batch, length):
        return jnp.zeros((batch, length, self.vocab), jnp.float32)

    def probe(self, x, positions, key_mask, idx, mask_id):
        # The stub has no attention: position idx[j] hidden is the canvas with that position masked.
        rows = jnp.arange(x.shape[0])[:, None]

        def hidden_one(j):
            return self.logits_fn(x.at[rows[:, 0], idx[:, j]].set(mask_id))[rows[:, 0], idx[:, j]]

        held_out = jax.vmap(hidden_one, out_axes=1)(jnp.arange(idx.shape[1]))
        return self.logits_fn(x).astype(jnp.float32), held_out.astype(jnp.float32)
