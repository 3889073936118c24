"""Rules that keep state across the steps of a block."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Int

from localleap_jax.rules.base import RuleBase, Signals, first_clause, most_confident, per_row, setting
from localleap_jax.rules.registry import register_rule


class StableState(NamedTuple):
    last: Int[Array, "B T"]  # the previous step's prediction at each block position (-1: none yet)
    run: Int[Array, "B T"]  # consecutive steps the prediction has been the same, this one included


@register_rule("stable")
@struct.dataclass
class Stable(RuleBase):
    """This project's worked example of a stateful rule: a candidate commits once its prediction has
    been the same for k consecutive steps and its confidence this step is >= c_min.

    The whole rule is `init` (no history at a block's start) and `update` (extend or restart each
    position's run); the loop resets the state when a row enters a new block and keeps it for rows
    that did not work this step."""

    k: int = setting(2, int, low=1)
    c_min: float = setting(0.5, low=0.0, high=1.0)
    clause_names = ("top1", "stable")

    def init(self, batch: int, block: int, vocab: int) -> StableState:
        return StableState(jnp.full((batch, block), -1, jnp.int32), jnp.zeros((batch, block), jnp.int32))

    def update(self, s: Signals, state: StableState):
        run = jnp.where(s.pred == state.last, state.run + 1, 1)
        steady = s.candidates & (run >= per_row(self.k)) & (s.conf >= per_row(self.c_min))
        return first_clause(most_confident(s.conf, s.candidates), steady), StableState(s.pred, run)
