"""The compiled likelihood programs: every Monte-Carlo mini-batch of a group of requests in one `fori_loop`,
and LLaDA's greedy-suffix check.

A group is R requests, each one left-padded canvas [T] holding its context and then its continuation, which
therefore ends every row: the last C positions (the window, C >= every continuation of the group) hold them
all. Only the window goes through the LM head, never [rows, T, V]. Per mini-batch the program builds
R x b noisy copies (the estimator's noise in the continuation, the context clean), runs one forward pass over
them (2 R b rows with guidance: the unconditional copies have every context token masked), and adds each
request's weighted cross-entropy, divided by b, to its total. Left padding is hidden from keys and positions
(the denoiser's key mask and positions from the row's first real token), so it changes nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.likelihood.estimators import Estimator
from localleap_jax.model import positions_from_mask


class Requests(NamedTuple):
    """A group of requests on the device (R rows; every leaf has R first)."""

    ids: Int[Array, "R T"]  # context then continuation, left-padded
    mask: Bool[Array, "R T"]  # True on real tokens
    length: Int[Array, "R"]  # continuation tokens (the last `length` real positions)
    keys: jax.Array  # [R] typed PRNG keys, one per request


def window_layout(requests: Requests, window: int):
    """(place [R, C]: continuation index of each window slot; context [R, T]: real tokens left of the
    continuation; sequence_start [R, C]: the window slot holding a row's first real token)."""
    T = requests.ids.shape[1]
    place = jnp.arange(window)[None, :] - (window - requests.length[:, None])
    context = requests.mask & (jnp.arange(T)[None, :] < (T - requests.length)[:, None])
    first = jnp.argmax(requests.mask, axis=1)  # each row's first real token
    sequence_start = (T - window + jnp.arange(window))[None, :] == first[:, None]
    return place, context, sequence_start


def window_logits(denoiser, x: Int[Array, "N T"], mask: Bool[Array, "N T"], window: int
                  ) -> Float[Array, "N C V"]:
    """fp32 logits scoring the last `window` positions (for a shifted family, the head at the position before)."""
    T, shift = x.shape[1], denoiser.shift
    hidden, _ = denoiser.full(x, positions_from_mask(mask), mask)
    return denoiser.head(hidden[:, T - window - shift:T - shift]).astype(jnp.float32)


def guided_logits(denoiser, x: Int[Array, "N T"], mask: Bool[Array, "N T"], context: Bool[Array, "N T"],
                  window: int, mask_id: int, cfg_scale, guided: bool) -> Float[Array, "N C V"]:
    """The window's logits, with classifier-free guidance when `guided`: the same rows with every context token
    masked run in the same pass, and the logits are un + (w + 1) (cond - un)."""
    if not guided:
        return window_logits(denoiser, x, mask, window)
    unconditional = jnp.where(context, mask_id, x)
    both = window_logits(denoiser, jnp.concatenate([x, unconditional]), jnp.concatenate([mask, mask]), window)
    cond, un = jnp.split(both, 2)
    return un + (cfg_scale + 1.0) * (cond - un)


def mc_loglikelihood(denoiser, requests: Requests, cfg_scale: Float[Array, ""], *, estimator: Estimator,
                     mask_id: int, batch_size: int, mc_batches: int, window: int, guided: bool
                     ) -> Float[Array, "R"]:
    """Each request's estimate: minus the mean over `mc_batches` mini-batches of
    (1 / b) sum over its b rows of weight_i * sum over masked j of CE_j."""
    R, T = requests.ids.shape
    b, C = batch_size, window
    place, context, sequence_start = window_layout(requests, C)
    maskable = jax.vmap(estimator.maskable)(place, requests.length, sequence_start)
    if denoiser.shift:  # the first real token has no hidden state before it to be scored from
        maskable &= ~sequence_start
    target = requests.ids[:, T - C:]  # [R, C]

    def one_mini_batch(m, total):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, m))(requests.keys)
        noise = jax.vmap(lambda k, p, ok: estimator.draw(k, b, p, ok))(keys, place, maskable)  # [R, b, C], [R, b]
        noisy_window = jnp.where(noise.masked, mask_id, target[:, None, :])
        x = jnp.concatenate([jnp.broadcast_to(requests.ids[:, None, :T - C], (R, b, T - C)), noisy_window], axis=2)
        rows = lambda a: a.reshape(R * b, *a.shape[2:])  # noqa: E731
        tile = lambda a: rows(jnp.broadcast_to(a[:, None], (R, b, *a.shape[1:])))  # noqa: E731
        logits = guided_logits(denoiser, rows(x), tile(requests.mask), tile(context), C, mask_id, cfg_scale, guided)
        logits = logits.reshape(R, b, C, -1)
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
            logits, jnp.broadcast_to(target[:, None, :, None], (R, b, C, 1)), axis=-1)[..., 0]
        per_row = jnp.sum(jnp.where(noise.masked, ce, 0.0), axis=2) * noise.weight  # [R, b]
        return total + jnp.sum(per_row, axis=1) / b

    total = jax.lax.fori_loop(0, mc_batches, one_mini_batch, jnp.zeros((R,), jnp.float32))
    return -total / mc_batches


def greedy_suffix(denoiser, requests: Requests, cfg_scale: Float[Array, ""], *, mask_id: int, window: int,
                  guided: bool) -> Bool[Array, "R"]:
    """LLaDA's `suffix_greedy_prediction`: from the context and an all-mask continuation, commit per pass the one
    most confident masked token (its argmax), L passes; True where that reproduces the continuation."""
    T = requests.ids.shape[1]
    C = window
    place, context, _ = window_layout(requests, C)
    in_continuation = (place >= 0)
    target = requests.ids[:, T - C:]
    start = requests.ids.at[:, T - C:].set(jnp.where(in_continuation, mask_id, target))

    def one_pass(_, x):
        window_now = x[:, T - C:]
        masked = in_continuation & (window_now == mask_id)
        logits = guided_logits(denoiser, x, requests.mask, context, C, mask_id, cfg_scale, guided)
        probs = jax.nn.softmax(logits, axis=-1)
        pred, conf = jnp.argmax(logits, axis=-1), jnp.max(probs, axis=-1)
        pick = jnp.argmax(jnp.where(masked, conf, -1.0), axis=1)  # [R]
        chosen = (jnp.arange(C)[None, :] == pick[:, None]) & masked
        return x.at[:, T - C:].set(jnp.where(chosen, pred, window_now))

    final = jax.lax.fori_loop(0, C, one_pass, start)
    return jnp.all(jnp.where(in_continuation, final[:, T - C:] == target, True), axis=1)
