"""A canvas rule's random draws for one pass: the uniform noise a row's canvas starts from and re-noises with, and
the key of the sample each pass draws from the model's distribution.

    source = prompt_draws(rng, prompts, supplied)      # once per generation, on the host: one entry per prompt
    draws = canvas_draws(source, prompt, passes, canvas_index, step, vocab=V, length=C)   # in the loop

Each prompt draws from its own key, `fold_in(rng, p)` for the prompt's index p in the caller's batch, folded with
the row's own count of passes and split into three streams (the canvas a row starting one takes, the sample, the
re-noise). The keys travel with the prompts (`PromptDraws` has one entry per prompt, split with the rows like the
ids), so a prompt draws the same wherever it runs: in a fixed batch or through slots (decode/slots.py: a slot reads
the entry of the prompt it holds), on one device, a mesh's data shards or `devices=`; and never depends on the
rows beside it or the pass the batch is at. `supplied` [prompts, J, N + 1, C] replaces the uniform draws
(transformers' generate has no deterministic mode: a test supplies the draws it makes): [p, j, 0] is prompt p's
canvas j as it starts, [p, j, i + 1] the re-noise after its pass i in it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, UInt32

INITIAL, SAMPLE, RENOISE = 0, 1, 2  # the streams of a row's key at a pass


class PromptDraws(NamedTuple):
    """Where each prompt's draws come from: an input of the program with one entry per prompt (row-split)."""

    keys: UInt32[Array, "N K"]  # the key data of fold_in(rng, prompt) (the default PRNG implementation's)
    noise: Int[Array, "N J S C"] | None = None  # supplied uniform draws (None: drawn from the keys)


def prompt_draws(rng: jax.Array, prompts: int, supplied: np.ndarray | None = None) -> PromptDraws:
    """Every prompt's draws for a batch of `prompts` (host arrays; `supplied`: the uniform draws, per prompt)."""
    keys = jax.vmap(lambda p: jax.random.fold_in(rng, p))(jnp.arange(prompts, dtype=jnp.int32))
    return PromptDraws(np.asarray(jax.random.key_data(keys)), supplied)


class Draws(NamedTuple):
    initial: Int[Array, "B C"]  # the canvas a row starting one takes
    renoise: Int[Array, "B C"]  # what the positions a pass does not accept take
    sample: jax.Array  # [B] keys: each row's sample from the pass's distribution


def canvas_draws(source: PromptDraws, prompt: Int[Array, "B"], passes: Int[Array, "B"],
                 canvas_index: Int[Array, "B"], step: Int[Array, "B"], *, vocab: int, length: int) -> Draws:
    """One pass's draws for every row: `prompt` each row's entry in `source`, `passes` the passes it has made,
    `canvas_index` and `step` its canvas and denoising pass in it."""
    keys = jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k), n))(source.keys[prompt], passes)
    stream = lambda which: jax.vmap(lambda k: jax.random.fold_in(k, which))(keys)  # noqa: E731
    if source.noise is None:
        uniform = jax.vmap(lambda k: jax.random.randint(k, (length,), 0, vocab, jnp.int32))
        initial, renoise = uniform(stream(INITIAL)), uniform(stream(RENOISE))
    else:
        initial = source.noise[prompt, canvas_index, 0].astype(jnp.int32)
        renoise = source.noise[prompt, canvas_index, step + 1].astype(jnp.int32)
    return Draws(initial, renoise, stream(SAMPLE))
