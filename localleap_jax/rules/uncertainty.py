"""Rules that rank by the shape of the whole distribution: top-2 margin, entropy, EB-Sampler."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from localleap_jax.rules.base import RuleBase, Signals, per_row, rank_by, setting, top_k
from localleap_jax.rules.registry import register_rule


@register_rule("margin")
@struct.dataclass
class Margin(RuleBase):
    """Top-k margin (Kim et al., arXiv 2502.06768; Dream's `topk_margin`): LLaDA's schedule for how
    many, ranked by top-1 minus top-2 probability instead of confidence."""

    steps: int | None = setting(None, int, low=1, none_ok=True)
    clause_names = ("schedule",)

    def update(self, s: Signals, state):
        return top_k(s.margin, s.candidates, s.quota(self.steps)), state


@register_rule("entropy")
@struct.dataclass
class Entropy(RuleBase):
    """Lowest entropy first (Dream's `entropy` remasking: confidence = -entropy): LLaDA's schedule for
    how many, ranked by negative entropy instead of confidence."""

    steps: int | None = setting(None, int, low=1, none_ok=True)
    clause_names = ("schedule",)

    def update(self, s: Signals, state):
        return top_k(-s.entropy, s.candidates, s.quota(self.steps)), state


@register_rule("eb")
@struct.dataclass
class EntropyBounded(RuleBase):
    """EB-Sampler (arXiv 2505.24857): sort the candidates by entropy, lowest first, and commit the
    largest prefix whose entropy sum minus its largest entropy is <= gamma."""

    gamma: float = setting(0.01, low=0.0)
    clause_names = ("entropy_budget",)

    def update(self, s: Signals, state):
        rank = rank_by(-s.entropy, s.candidates)  # 0 = lowest entropy
        order = jnp.argsort(rank, axis=-1)
        ent = jnp.where(s.candidates, s.entropy, 0.0)
        sorted_ent = jnp.take_along_axis(ent, order, axis=-1)
        # Sorted ascending, a prefix's max is its last entry: sum minus max = the sum of the entries before.
        before = jnp.cumsum(sorted_ent, axis=-1) - sorted_ent
        within = jnp.take_along_axis(before <= per_row(self.gamma), rank, axis=-1)
        return s.candidates & within, state  # never empty: the lowest-entropy candidate has nothing before it
