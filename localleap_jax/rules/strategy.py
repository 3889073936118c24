"""One way to say a rule: a rule object, or a spec string, resolved once to the rule object.

    rule, traits = rules.resolve("localleap:kappa=0.8")    # what DecodeConfig(strategy=...) does at construction
    rule = rules.with_shared_settings("localleap", kappa=0.8, steps=64)   # the command lines' shared flags

The command lines' shared flags (`--kappa`, `--tau`, `--radius`, `--steps` of eval_gsm8k, sweep and
analyze_dynamics; `kappa=`, ... in the lm-eval adapter's model_args) are settings several rules share: each
applies to a rule that has a setting of that name and never overrides a value the spec gives
(`--kappa 0.8 --strategies threshold,localleap:kappa=0.95` runs threshold at 0.8 and localleap at 0.95); a rule
without it ignores it, though a value out of its range is refused all the same.
"""

from __future__ import annotations

import dataclasses

from flax import struct

from localleap_jax.rules.base import DecodeError, Rule, RuleBase, check_settings, setting
from localleap_jax.rules.failures import check_calls
from localleap_jax.rules.registry import RULES, parse_spec, rule, unknown_rule
from localleap_jax.rules.traits import RuleTraits, traits_of


def as_rule(strategy):
    """The rule object a strategy names (see `resolve`)."""
    return resolve(strategy)[0]


def resolve(strategy) -> tuple[Rule, RuleTraits]:
    """(the rule object a strategy names, its traits): a spec string parsed (an unknown name or setting refused), a
    rule object checked (every member of the Rule protocol, its traits, init and update taking the loop's
    arguments). One DecodeError line for anything else."""
    if isinstance(strategy, str):
        resolved = rule(strategy)
    elif isinstance(strategy, type):
        raise DecodeError(f"strategy must be a rule (ll.rule(...), ll.stateless(fn)) or a rule name; got the class "
                          f"{strategy.__name__} (pass an instance: {strategy.__name__}(...))")
    elif not callable(getattr(strategy, "update", None)):
        raise DecodeError(f"strategy must be a rule (ll.rule(...), ll.stateless(fn)) or a rule name; got "
                          f"{type(strategy).__name__} {strategy!r}")
    else:
        resolved = strategy
    traits = traits_of(resolved)
    check_calls(resolved)
    return resolved, traits


@struct.dataclass
class SharedSettings(RuleBase):
    """The shared flags, with the ranges of the rules that take them (kappa, tau and radius: localleap's; steps:
    LLaDA's schedule's), for a value the named rule ignores."""

    kappa: float | None = setting(None, low=0.0, high=1.0, low_open=True, none_ok=True)
    tau: float | None = setting(None, low=0.0, high=1.0, low_open=True, none_ok=True)
    radius: int | None = setting(None, int, low=0, none_ok=True)
    steps: int | None = setting(None, int, low=1, none_ok=True)
    name = "shared setting"


SHARED_SETTINGS = tuple(f.name for f in dataclasses.fields(SharedSettings))


def settings_taken(name: str) -> set[str]:
    """The settings a rule registered under `name` takes (a rule given as a function takes none)."""
    cls = RULES[name]
    if not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls) if "setting" in f.metadata}


def with_shared_settings(rule_or_spec, *, kappa: float | None = None, tau: float | None = None,
                         radius: int | None = None, steps: int | None = None):
    """The rule a spec names with the shared flags applied (see the module's docstring; None: not given). A rule
    object holds every setting already: a shared flag beside one is refused."""
    given = {k: v for k, v in dict(kappa=kappa, tau=tau, radius=radius, steps=steps).items() if v is not None}
    if not isinstance(rule_or_spec, str):
        resolved = as_rule(rule_or_spec)
        if given:
            raise DecodeError(f"{', '.join(given)} given beside a rule object: set them on the rule, e.g. "
                              f"ll.rule({resolved.name!r}, {', '.join(f'{k}=...' for k in given)})")
        return resolved
    name, in_spec = parse_spec(rule_or_spec)
    if name not in RULES:
        raise DecodeError(unknown_rule(name))
    takes = settings_taken(name)
    check_settings(SharedSettings(**{k: v for k, v in given.items() if k not in takes}))
    return as_rule(rule(rule_or_spec, **{k: v for k, v in given.items() if k in takes and k not in in_spec}))


__all__ = ["SHARED_SETTINGS", "SharedSettings", "as_rule", "resolve", "settings_taken", "with_shared_settings"]
