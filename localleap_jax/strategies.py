"""Deprecated module name: the commit rules live in `localleap_jax.rules`.

Kept so that `ll.STRATEGIES`, `ll.register` and the old helpers keep working:
  STRATEGIES   the rule registry (name -> rule class or factory), `rules.RULES`
  register     registers a rule dataclass, a function of the signals, or an old-form
               function `fn(conf, candidates, p: RuleParams)` (kappa/tau/radius static)
  dilate       the old static-radius max-pool; rules now use `rules.near_any` (traced radius)
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Bool

from localleap_jax.rules import RULES as STRATEGIES
from localleap_jax.rules import RuleParams, most_confident, register

__all__ = ["STRATEGIES", "RuleParams", "dilate", "most_confident", "register"]


def dilate(mask: Bool[Array, "B T"], radius: int) -> Bool[Array, "B T"]:
    """True within a static `radius` of any True: a max-pool of width 2 * radius + 1."""
    if radius == 0:
        return mask
    return jax.lax.reduce_window(mask, False, jax.lax.bitwise_or, window_dimensions=(1, 2 * radius + 1),
                                 window_strides=(1, 1), padding=((0, 0), (radius, radius)))
