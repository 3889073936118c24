"""Canvas rules: decoding rules for a uniform-noise canvas model (DiffusionGemma), which has no mask token.

A canvas of `block_length` tokens starts as uniform noise; each denoising pass the model scores every position,
the rule accepts some positions (they take a token it chooses, a sample or the argmax) and the loop re-noises
the rest with fresh uniform draws; the rule also says when the canvas is finished, and the finished canvas keeps
the pass's argmax (transformers' `DiffusionGemmaGenerationMixin.generate`). A canvas rule declares `canvas = True`
(read once into the loop's settings, `traits.RuleTraits.canvas`) and has, besides the Rule protocol's members:

    T = rule.temperature(step)                   # [B]: the temperature of denoising pass `step` (0 first)
    decision, state = rule.update(signals, state)   # signals: CanvasSignals; decision: CanvasDecision

`CanvasSignals` hold the pass's logits at that temperature, a sample from them (the loop's draw: a key per row
and pass), the argmax, the canvas fed in and the entropies; `CanvasDecision(accept, tokens, finished)`: accept
[B, C] (bool, or int8 clause codes naming `clause_names`), the token each accepted position takes, and the rows
whose canvas is finished after this pass ([B] bool). The loop keeps the rest (decode/step.py `canvas_step`, the
loop's canvas bookkeeping): re-noising, the self-conditioning input, the argmax canvas kept, EOS ending a row,
NFE. Settings are traced per row, as every rule's.

  entropy_bound       transformers' EntropyBoundSampler, its linear temperature schedule and its
                      StableAndConfidentStoppingCriteria (DiffusionGemma's own sampler)
  localleap_uniform   LocalLeap for uniform noise: the entropy bound, plus positions within `radius` of a
                      low-entropy accepted anchor at a relaxed entropy bound
"""

from __future__ import annotations

import functools
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.rules.base import DecodeError, RuleBase, first_clause, per_row, setting
from localleap_jax.rules.confidence import near_any
from localleap_jax.rules.registry import register_rule


def entropy(z: Float[Array, "*B V"]) -> Float[Array, "*B"]:
    """Entropy of softmax(z) in nats, as torch.distributions.Categorical(logits=z).entropy() computes it (fp32)."""
    z = z.astype(jnp.float32)
    logp = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
    return -jnp.sum(logp * jax.nn.softmax(z, axis=-1), axis=-1)


def entropy_bound_accept(H: Float[Array, "B C"], bound) -> Bool[Array, "B C"]:
    """EntropyBoundSampler.accept_canvas (arXiv 2505.24857): sort the positions by entropy ascending and accept
    the prefix whose entropies before each one sum to at most `bound` ([B] or a scalar); the lowest-entropy
    position always. Ties in entropy at the boundary: the earlier position wins (a stable sort; torch.sort
    promises no order)."""
    order = jnp.argsort(H, axis=-1, stable=True)
    sorted_h = jnp.take_along_axis(H, order, axis=-1)
    before = jnp.cumsum(sorted_h, axis=-1) - sorted_h
    chosen = before <= per_row(jnp.asarray(bound, jnp.float32))
    rows = jnp.arange(H.shape[0])[:, None]
    return jnp.zeros(H.shape, bool).at[rows, order].set(chosen)


def linear_temperature(step: Int[Array, "B"], steps, t_min, t_max) -> Float[Array, "B"]:
    """transformers' LinearTemperatureScheduleLogitsProcessor at cur_step = N - step: t_min + (t_max - t_min) *
    (N - step) / N in fp32 (t_max at step 0; t_min + (t_max - t_min) / N at the last step). Settings given per
    row are fp32 already, so t_max - t_min is their fp32 difference: transformers rounds the exact difference of
    its Python floats, which can differ in the last bit for other values than the defaults."""
    steps = jnp.asarray(steps, jnp.int32)
    fraction = (steps - jnp.asarray(step, jnp.int32)).astype(jnp.float32) / steps.astype(jnp.float32)
    t_min = jnp.asarray(t_min, jnp.float32)
    return t_min + (jnp.asarray(t_max, jnp.float32) - t_min) * fraction


class StopState(NamedTuple):
    """StableAndConfidentStoppingCriteria's history as a run: the previous pass's argmax canvas and how many passes
    in a row ended with that same canvas (0 before the first pass). "The argmax equals each of the last S" is
    "it equals the previous one, which has been the same for >= S passes", so S can be a per-row setting."""

    last: Int[Array, "B C"]
    same: Int[Array, "B"]


def stable_and_confident(argmax: Int[Array, "B C"], H: Float[Array, "B C"], state: StopState, stability,
                         confidence) -> tuple[Bool[Array, "B"], StopState]:
    """transformers' StableAndConfidentStoppingCriteria: stop a row when its argmax canvas equals that of each of the
    last `stability` passes (0: always stable) and its mean entropy is below `confidence` (strictly)."""
    equal = jnp.all(argmax == state.last, axis=1)
    stability = jnp.asarray(stability, jnp.int32)
    stable = (stability == 0) | (equal & (state.same >= stability))
    confident = jnp.mean(H, axis=-1) < jnp.asarray(confidence, jnp.float32)
    return stable & confident, StopState(argmax.astype(jnp.int32), jnp.where(equal, state.same + 1, 1))


class CanvasSignals:
    """What one denoising pass knows about each position of every row's canvas (a canvas rule's signals).

    `logits` are the pass's fp32 logits divided by its temperature (`rule.temperature(step)`): the distribution
    the sample is drawn from, the entropies are measured on and the next pass is self-conditioned on. `sample` is
    a draw from softmax(logits) (per row and pass), `argmax` its mode, `tokens` the canvas fed in, `step` the
    denoising pass (0 at a canvas's first)."""

    def __init__(self, *, logits: Float[Array, "B C V"], sample: Int[Array, "B C"], argmax: Int[Array, "B C"],
                 tokens: Int[Array, "B C"], step: Int[Array, "B"]):
        self.logits = logits
        self.sample = sample
        self.argmax = argmax
        self.tokens = tokens
        self.step = step

    @functools.cached_property
    def entropy(self) -> Float[Array, "B C"]:
        """Entropy of softmax(logits) at each position, in nats."""
        return entropy(self.logits)


class CanvasDecision(NamedTuple):
    """What a canvas rule returns: the positions that keep their token this pass (bool, or int8 codes naming
    `clause_names`; the loop re-noises the others), the token each accepted position takes, and the rows whose
    canvas is finished after this pass ([B] bool: the loop keeps its argmax canvas)."""

    accept: Array
    tokens: Int[Array, "B C"]
    finished: Bool[Array, "B"]


class CanvasRuleBase(RuleBase):
    """Mixin for canvas rules: the trait, the stop criterion's state, the temperature schedule, the pass bound.
    A subclass holds the settings `t_min`, `t_max`, `max_denoising_steps` and implements `update`."""

    canvas: ClassVar[bool] = True

    def init(self, batch: int, block: int, vocab: int) -> StopState:
        return StopState(jnp.full((batch, block), -1, jnp.int32), jnp.zeros((batch,), jnp.int32))

    def temperature(self, step: Int[Array, "B"]) -> Float[Array, "B"]:
        return linear_temperature(step, self.max_denoising_steps, self.t_min, self.t_max)

    def pass_bound(self, gen_length: int, block_length: int) -> int:
        """Every canvas takes at most max_denoising_steps passes."""
        return -(-gen_length // block_length) * int(np.max(np.asarray(self.max_denoising_steps)))

    def min_passes(self, gen_length: int, block_length: int) -> int:
        return max(gen_length // block_length, 1)


@register_rule("entropy_bound")
@struct.dataclass
class EntropyBound(CanvasRuleBase):
    """DiffusionGemma's sampler as transformers runs it (`models/diffusion_gemma/generation_diffusion_gemma.py`):
    per pass i of a canvas (from 0), the logits at temperature t_min + (t_max - t_min) (N - i) / N (N =
    max_denoising_steps); accept the positions of the longest prefix, by entropy ascending, whose entropies
    before each one sum to <= entropy_bound (at least the lowest-entropy one; clause "bound"); an accepted position
    takes its sample (greedy = 1: the argmax; transformers always samples, so greedy is for exact comparisons);
    the canvas is finished when its argmax canvas equals that of each of the last stability_threshold passes and
    its mean entropy is < confidence_threshold, or after pass N - 1. Defaults: transformers' generation
    defaults."""

    entropy_bound: float = setting(0.1, low=0.0)
    t_min: float = setting(0.4, low=0.0)
    t_max: float = setting(0.8, low=0.0, low_open=True)
    max_denoising_steps: int = setting(48, int, low=1)
    stability_threshold: int = setting(1, int, low=0)
    confidence_threshold: float = setting(0.005, low=0.0, low_open=True)
    greedy: int = setting(0, int, low=0, high=1)
    clause_names = ("bound",)

    def validate(self, gen_length=None, block_length=None):
        super().validate()
        if not any(isinstance(v, jax.core.Tracer) for v in (self.t_min, self.t_max)):
            t_min, t_max = np.broadcast_arrays(np.asarray(self.t_min, np.float64), np.asarray(self.t_max, np.float64))
            if np.any(t_max <= t_min):
                raise DecodeError(f"{self.name}: t_max must be above t_min (the temperature falls from t_max to t_min "
                                  f"over the passes); got t_min={self.t_min}, t_max={self.t_max}")
        return self

    def accept(self, s: CanvasSignals) -> Array:
        """The positions that keep their token: the entropy bound's (codes: clause_names)."""
        return entropy_bound_accept(s.entropy, self.entropy_bound)

    def update(self, s: CanvasSignals, state: StopState):
        stop, state = stable_and_confident(s.argmax, s.entropy, state, self.stability_threshold,
                                           self.confidence_threshold)
        last_pass = s.step + 1 >= jnp.asarray(self.max_denoising_steps, jnp.int32)
        tokens = jnp.where(per_row(self.greedy) > 0, s.argmax, s.sample)
        return CanvasDecision(self.accept(s), tokens, stop | last_pass), state


@register_rule("localleap_uniform")
@struct.dataclass
class LocalLeapUniform(EntropyBound):
    """LocalLeap for uniform noise (this project's; the LocalLeap paper's idea, arXiv 2510.07081, on a canvas
    without masks): a confident position makes its neighbours safe at a lower bar. Per pass, the entropy bound's
    positions are accepted (clause "bound"); those of them whose entropy is <= anchor_entropy are anchors; a
    position within `radius` of an anchor whose entropy is <= relaxed_entropy is accepted too (clause "near_anchor").
    Every other setting (the temperature schedule, the stop, greedy) is entropy_bound's. The bound's sum caps how
    many independent guesses one pass keeps; the anchors' neighbourhood admits more, betting that tokens next to a
    near-certain one are as dependable as their own entropy says, though their sum would exceed the bound.
    relaxed_entropy = 0 (or radius 0 with anchors the bound already accepts) gives entropy_bound itself."""

    anchor_entropy: float = setting(0.1, low=0.0)
    relaxed_entropy: float = setting(0.5, low=0.0)
    radius: int = setting(4, int, low=0)
    clause_names = ("bound", "near_anchor")

    def accept(self, s: CanvasSignals) -> Array:
        bound = entropy_bound_accept(s.entropy, self.entropy_bound)
        anchors = bound & (s.entropy <= per_row(self.anchor_entropy))
        near = near_any(anchors, self.radius) & (s.entropy <= per_row(self.relaxed_entropy))
        return first_clause(bound, near)


__all__ = ["CanvasDecision", "CanvasRuleBase", "CanvasSignals", "EntropyBound", "LocalLeapUniform", "StopState",
           "entropy", "entropy_bound_accept", "linear_temperature", "stable_and_confident"]
