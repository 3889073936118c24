"""A canvas rule's random draws for one pass: the uniform noise a row's canvas starts from and re-noises with, and
the key of the sample each pass draws from the model's distribution.

    draws = canvas_draws(rng, prompt, passes, supplied, canvas_index, step, vocab=V, length=C)

Each row draws from its own key, `fold_in(fold_in(rng, prompt), pass)`: its prompt's index (its row in a fixed
batch; in continuous batching the prompt its slot holds, decode/slots.py) and its own count of passes, split into
three streams (the canvas a row starting one takes, the sample, the re-noise). So a row's draws depend on neither
the rows beside it nor the pass the batch is at: a prompt draws the same in a fixed batch and through slots.
`supplied` [prompts, J, N + 1, C] replaces the uniform draws (transformers' generate has no deterministic mode: a
test supplies the draws it makes): [p, j, 0] is prompt p's canvas j as it starts, [p, j, i + 1] the re-noise after
its pass i in it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

INITIAL, SAMPLE, RENOISE = 0, 1, 2  # the streams of a row's key at a pass


class Draws(NamedTuple):
    initial: Int[Array, "B C"]  # the canvas a row starting one takes
    renoise: Int[Array, "B C"]  # what the positions a pass does not accept take
    sample: jax.Array  # [B] keys: each row's sample from the pass's distribution


def canvas_draws(rng: jax.Array, prompt: Int[Array, "B"], passes: Int[Array, "B"],
                 supplied: Int[Array, "N J S C"] | None, canvas_index: Int[Array, "B"], step: Int[Array, "B"], *,
                 vocab: int, length: int) -> Draws:
    """One pass's draws for every row: `prompt` each row's prompt index, `passes` the passes it has made,
    `canvas_index` and `step` its canvas and denoising pass in it."""
    keys = jax.vmap(lambda p, n: jax.random.fold_in(jax.random.fold_in(rng, p), n))(prompt, passes)
    stream = lambda which: jax.vmap(lambda k: jax.random.fold_in(k, which))(keys)  # noqa: E731
    if supplied is None:
        uniform = jax.vmap(lambda k: jax.random.randint(k, (length,), 0, vocab, jnp.int32))
        initial, renoise = uniform(stream(INITIAL)), uniform(stream(RENOISE))
    else:
        initial = supplied[prompt, canvas_index, 0].astype(jnp.int32)
        renoise = supplied[prompt, canvas_index, step + 1].astype(jnp.int32)
    return Draws(initial, renoise, stream(SAMPLE))
