"""Rules that keep state across the steps of a block."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.rules.base import RuleBase, Signals, first_clause, most_confident, per_row, setting, top_k
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


class KlassState(NamedTuple):
    prev: Float[Array, "B T V"]  # the previous pass's log-probabilities at each block position
    has_prev: Bool[Array, "B"]  # False at a block's first pass
    run: Int[Array, "B T"]  # consecutive passes, ending at this one, whose KL stayed < tau_kl


@register_rule("klass")
@struct.dataclass
class Klass(RuleBase):
    """KLASS (arXiv 2511.05664; the authors' `stable_confident_decode` in shkim0116/KLASS,
    src/model/llada_klass.py): commit the candidates whose confidence is > tau_c and whose
    KL(this pass || previous pass) stayed < tau_kl for the last `history` passes of the block; when none
    is ready, LLaDA's schedule by confidence (`steps` as low_confidence).

    Where this differs from the authors' code: the history restarts at every block (they keep it over
    the whole generation, which would need [B, L, V]; here the state is the block's [B, T, V]), and the
    KL is exact (they add 1e-12 inside both logs). State per row at LLaDA-8B's block 32 and vocabulary
    126464: 32 x 126464 fp32 log-probabilities, 16.2 MB."""

    tau_c: float = setting(0.9, low=0.0, high=1.0)
    tau_kl: float = setting(0.01, low=0.0, low_open=True)
    history: int = setting(2, int, low=1)
    steps: int | None = setting(None, int, low=1, none_ok=True)
    clause_names = ("stable_kl", "fallback")

    def init(self, batch: int, block: int, vocab: int) -> KlassState:
        return KlassState(jnp.zeros((batch, block, vocab), jnp.float32), jnp.zeros((batch,), bool),
                          jnp.zeros((batch, block), jnp.int32))

    def update(self, s: Signals, state: KlassState):
        logp = jax.nn.log_softmax(s.logits, axis=-1)
        p = jnp.exp(logp)
        # Ids with p = 0 add nothing; p > 0 where the previous p was 0 makes the KL infinite (not stable).
        kl = jnp.sum(jnp.where(p > 0, p * (logp - state.prev), 0.0), axis=-1)
        calm = state.has_prev[:, None] & (kl < per_row(self.tau_kl))
        run = jnp.where(calm, state.run + 1, 0)
        ready = s.candidates & (s.conf > per_row(self.tau_c)) & (run >= per_row(self.history))
        none_ready = ~jnp.any(ready, axis=-1, keepdims=True)
        fallback = none_ready & top_k(s.conf, s.candidates, s.quota(self.steps))
        return first_clause(ready, fallback), KlassState(logp, jnp.ones_like(state.has_prev), run)
