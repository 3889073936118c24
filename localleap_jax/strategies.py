"""Commit rules: which still-masked positions of the current block take their prediction this step.

A rule is a pure function over one step's arrays (the current block of every row):

    rule(conf [B, T], candidates [B, T], p: RuleParams) -> commit [B, T]

`conf` is the softmax probability of each position's prediction, `candidates` marks the
positions still masked. A rule must commit only candidates and at least one per row that has
any (decode.py also enforces both). Shapes are static and nothing indexes by data, so a rule
compiles into the single generation loop. A new strategy is one decorated function here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


class RuleParams(NamedTuple):
    kappa: float  # anchor / plain threshold
    tau: float  # relaxed threshold next to an anchor
    radius: int  # W: how far an anchor's influence reaches
    quota: Int[Array, "B"]  # tokens LLaDA's fixed schedule commits this step (low_confidence)


class CommitRule(Protocol):
    def __call__(self, conf: Float[Array, "B T"], candidates: Bool[Array, "B T"],
                 p: RuleParams) -> Bool[Array, "B T"]: ...


STRATEGIES: dict[str, CommitRule] = {}


def register(name: str) -> Callable[[CommitRule], CommitRule]:
    def add(rule: CommitRule) -> CommitRule:
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} is already registered")
        STRATEGIES[name] = rule
        return rule
    return add


def get(name: str) -> CommitRule:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(sorted(STRATEGIES))}") from None


# ---------------------------------------------------------------- helpers


def most_confident(conf: Float[Array, "B T"], candidates: Bool[Array, "B T"]) -> Bool[Array, "B T"]:
    """One-hot of each row's most confident candidate (lowest index on ties); empty if none."""
    best = jnp.argmax(jnp.where(candidates, conf, -jnp.inf), axis=-1)
    return candidates & (jnp.arange(conf.shape[-1]) == best[:, None])


def dilate(mask: Bool[Array, "B T"], radius: int) -> Bool[Array, "B T"]:
    """True within `radius` positions of any True: a max-pool of width 2*radius + 1."""
    if radius == 0:
        return mask
    return jax.lax.reduce_window(mask, False, jax.lax.bitwise_or, window_dimensions=(1, 2 * radius + 1),
                                 window_strides=(1, 1), padding=((0, 0), (radius, radius)))


# ---------------------------------------------------------------- rules


@register("low_confidence")
def low_confidence(conf, candidates, p: RuleParams):
    """LLaDA's baseline: the `quota` most confident candidates (quota from the fixed schedule)."""
    masked = jnp.where(candidates, conf, -jnp.inf)
    order = jnp.argsort(-masked, axis=-1, stable=True)  # most confident first, ties by index
    rank = jnp.argsort(order, axis=-1, stable=True)
    return candidates & ((rank < p.quota[:, None]) | most_confident(conf, candidates))


@register("threshold")
def threshold(conf, candidates, p: RuleParams):
    """Fast-dLLM: the most confident candidate, and every candidate with conf >= kappa."""
    return most_confident(conf, candidates) | (candidates & (conf >= p.kappa))


@register("localleap")
def localleap(conf, candidates, p: RuleParams):
    """LocalLeap: threshold decoding, plus conf >= tau within `radius` of an anchor (conf >= kappa)."""
    anchors = candidates & (conf >= p.kappa)
    near_anchor = dilate(anchors, p.radius)
    return most_confident(conf, candidates) | anchors | (candidates & near_anchor & (conf >= p.tau))
