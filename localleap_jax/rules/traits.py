"""What the loop reads of a rule, read once: that it is a rule at all, and its traits.

    traits = rules.traits_of(rule)     # RuleTraits(region, probes, remask_names, resets_state, edit_names,
                                       #            ends_blocks, canvas, rewrites, soft_input), checked

A rule's traits are static (they shape the compiled program): the class attributes the `Rule` protocol declares,
with `RuleBase`'s defaults (region "block", no probes, no remask or edit clauses, state reset per block, a block
ending when its last mask fills, not a canvas rule, writing its predictions where they were predicted, feeding the
next pass nothing). `DecodeConfig`
reads them here, once, into the loop's compile-time settings (`LoopSettings.traits`); nothing in `decode/` reads a
rule's attributes. An object without every member of the protocol (a user's class that does not subclass
RuleBase) is refused in one line naming what it lacks.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import numpy as np

from localleap_jax.rules.base import DecodeError, Rule

REGIONS = ("block", "generated")


class RuleTraits(NamedTuple):
    """A rule's static traits (hashable: part of the compiled program's key)."""

    region: str = "block"  # what the rule sees and changes: the current block, or the generated region up to its end
    probes: bool = False  # the pass also scores each block position with that position hidden (signals.held_out)
    remask_names: tuple[str, ...] = ()  # the rule's remask clauses (non-empty: it takes commits back)
    resets_state: bool = True  # False: the rule's state spans blocks (kept when a row enters a new block)
    edit_names: tuple[str, ...] = ()  # the rule's edit clauses (non-empty: it replaces held tokens)
    ends_blocks: bool = False  # True: the rule says when its row's block is finished (Decision.finished)
    canvas: bool = False  # True: a canvas rule (a uniform-noise canvas, no masks: rules.canvas)
    rewrites: bool = False  # True: the rule returns the region it writes (Decision.block; credit, insert/delete)
    soft_input: bool = False  # True: the rule weighs the next pass's input embedding (Decision.soft_weight; smooth)

    @property
    def revokes(self) -> bool:
        return bool(self.remask_names)

    @property
    def edits(self) -> bool:
        return bool(self.edit_names)

    @property
    def decides(self) -> bool:
        """The rule returns a Decision (it remasks, edits, ends its blocks, rewrites them or feeds the next pass), not
        a bare commit."""
        return self.revokes or self.edits or self.ends_blocks or self.rewrites or self.soft_input

    @property
    def own_bound(self) -> bool:
        """A working pass may leave as many masks as before (a remask, a pass with no mask left): the loop's bound
        is the rule's `pass_bound`, not one pass per generated position. (A rewritten block may hold more masks than
        before.)"""
        return self.revokes or self.ends_blocks or self.canvas or self.rewrites


def protocol_members() -> tuple[str, ...]:
    """Every name the Rule protocol declares: its attributes, then its methods."""
    methods = [name for name, value in vars(Rule).items() if inspect.isfunction(value) and not name.startswith("_")]
    return (*Rule.__annotations__, *methods)


def _called(rule) -> str:
    name = rule.name if isinstance(getattr(rule, "name", None), str) else None
    return f"rule {name!r}" if name else f"{type(rule).__name__} {rule!r}"


def traits_of(rule) -> RuleTraits:
    """The rule's traits, checked: every protocol member present, a region the loop knows, probes only over the
    block, remask_names and edit_names tuples of names, probes, resets_state and ends_blocks True or False. One
    DecodeError line otherwise."""
    missing = [m for m in protocol_members() if not hasattr(rule, m)]
    if missing:
        raise DecodeError(f"{_called(rule)} lacks {', '.join(missing)} of the Rule protocol: subclass "
                          "ll.rules.RuleBase (a flax.struct.dataclass), which gives every default, or use "
                          "ll.stateless(fn)")
    region, probes, names, resets = rule.region, rule.probes, rule.remask_names, rule.resets_state
    edit_names, ends_blocks, canvas = rule.edit_names, rule.ends_blocks, rule.canvas
    rewrites, soft_input = rule.rewrites, rule.soft_input
    if not isinstance(region, str) or region not in REGIONS:
        raise DecodeError(f"{rule.name}: region={region!r}; a rule's region is 'block' or 'generated'")
    for trait, value in (("probes", probes), ("resets_state", resets), ("ends_blocks", ends_blocks),
                         ("canvas", canvas), ("rewrites", rewrites), ("soft_input", soft_input)):
        if not isinstance(value, (bool, np.bool_)):
            raise DecodeError(f"{rule.name}: {trait}={value!r} must be True or False")
    if probes and region != "block":
        raise DecodeError(f"{rule.name}: probes score the current block; a rule with region {region!r} cannot "
                          "have them")
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise DecodeError(f"{rule.name}: remask_names={names!r} must be a tuple of names, e.g. ('doubt',)")
    if not isinstance(edit_names, tuple) or not all(isinstance(n, str) for n in edit_names):
        raise DecodeError(f"{rule.name}: edit_names={edit_names!r} must be a tuple of names, e.g. ('changed',)")
    if canvas:
        masked = [t for t, on in (("region 'generated'", region != "block"), ("probes", probes),
                                  ("remask_names", names), ("edit_names", edit_names), ("ends_blocks", ends_blocks),
                                  ("rewrites", rewrites), ("soft_input", soft_input))
                  if on]
        if masked:
            raise DecodeError(f"{rule.name}: a canvas rule (canvas = True) works on a canvas without masks; it cannot "
                              f"also declare {', '.join(masked)} (traits of rules over masked blocks)")
        if not callable(getattr(rule, "temperature", None)):
            raise DecodeError(f"{rule.name}: a canvas rule has temperature(step) -> [B] (the temperature of each "
                              "row's denoising pass): subclass ll.rules.canvas.CanvasRuleBase")
    if soft_input and (region != "block" or probes):
        raise DecodeError(f"{rule.name}: a rule that feeds the next pass an input embedding (soft_input) decides on "
                          "its block alone (region 'block', no probes)")
    return RuleTraits(region, bool(probes), names, bool(resets), edit_names, bool(ends_blocks), bool(canvas),
                      bool(rewrites), bool(soft_input))
