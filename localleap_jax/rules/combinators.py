"""Rules made of rules: `any_of` commits what any sub-rule commits, `all_of` what all of them do.
The tuple of sub-states is threaded through, as optax.chain does."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

from localleap_jax.rules.base import DecodeError, RuleBase, Signals
from localleap_jax.rules.traits import traits_of


@struct.dataclass
class AnyOf(RuleBase):
    """Commit where any sub-rule commits; the clause is that of the first sub-rule that commits."""

    rules: tuple = ()
    name = "any_of"

    @property
    def clause_names(self) -> tuple[str, ...]:
        return tuple(f"{r.name}.{c}" for r in self.rules for c in r.clause_names)

    def init(self, batch, block, vocab):
        return tuple(r.init(batch, block, vocab) for r in self.rules)

    def update(self, s: Signals, state):
        codes, states = _run_all(self.rules, s, state)
        out = jnp.zeros(s.candidates.shape, jnp.int8)
        offset = sum(len(r.clause_names) for r in self.rules)
        for r, code in zip(reversed(self.rules), reversed(codes)):  # the first committing sub-rule wins
            offset -= len(r.clause_names)
            out = jnp.where(code > 0, code + jnp.int8(offset), out)
        return out, states

    def validate(self, gen_length=None, block_length=None):
        for r in self.rules:
            traits = traits_of(r)
            why = [what for what, holds in (("takes commits back", traits.revokes), ("edits", traits.edits),
                                            ("ends its own blocks", traits.ends_blocks),
                                            ("rewrites its block", traits.rewrites),
                                            ("feeds the next pass an input embedding", traits.soft_input),
                                            (f"sees the {traits.region} region", traits.region != "block"),
                                            ("probes the block", traits.probes),
                                            ("keeps its state across blocks", not traits.resets_state)) if holds]
            if why:
                raise DecodeError(f"{r.name} {' and '.join(why)}: it cannot be combined with any_of/all_of (a union "
                                  "or intersection of commits has no remask to merge, and its parts see the block "
                                  "alone, each pass, their states reset with each block)")
            r.validate(gen_length, block_length)
        return self

    def with_rows(self, batch: int):
        return dataclasses.replace(self, rules=tuple(r.with_rows(batch) for r in self.rules))

    def spec(self) -> str:
        return f"{self.name}(" + " | ".join(r.spec() for r in self.rules) + ")"


@struct.dataclass
class AllOf(AnyOf):
    """Commit where every sub-rule commits (named by the first sub-rule's clause)."""

    name = "all_of"

    @property
    def clause_names(self) -> tuple[str, ...]:
        return tuple(f"{self.rules[0].name}.{c}" for c in self.rules[0].clause_names)

    def update(self, s: Signals, state):
        codes, states = _run_all(self.rules, s, state)
        every = jnp.all(jnp.stack([c > 0 for c in codes]), axis=0)
        return jnp.where(every, codes[0].astype(jnp.int8), jnp.int8(0)), states


def _run_all(rules, s: Signals, state):
    results = [r.update(s, st) for r, st in zip(rules, state)]
    return [c.astype(jnp.int8) for c, _ in results], tuple(st for _, st in results)


def _parts(kind: str, given: tuple) -> tuple:
    """The sub-rules of a combinator, rule objects (checked by `validate`: each has the Rule protocol); none, or a
    name in place of a rule, is one line."""
    if not given:
        raise DecodeError(f"{kind} takes one or more rules, e.g. ll.{kind}(ll.rule('threshold'), ll.rule('stable'))")
    for r in given:
        if isinstance(r, str):
            raise DecodeError(f"{kind} takes rule objects: ll.rule({r!r}), not the name {r!r}")
    return tuple(given)


def any_of(*rules) -> AnyOf:
    return AnyOf(_parts("any_of", rules)).validate()


def all_of(*rules) -> AllOf:
    return AllOf(_parts("all_of", rules)).validate()
