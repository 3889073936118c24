"""Rules by name: the registry, `rule("name:setting=value,...")`, and the legacy function form."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, NamedTuple

from flax import struct
from jaxtyping import Array, Int

from localleap_jax.rules.base import DecodeError, RuleBase, Signals, setting, settings_of

RULES: dict[str, Any] = {}  # name -> rule class (or a factory taking the settings as keywords)


def register_rule(name: str):
    """Class decorator: make a rule dataclass reachable as `rule(name, **settings)`."""
    def add(cls):
        if name in RULES:
            raise ValueError(f"rule {name!r} is already registered")
        cls.name = name
        RULES[name] = cls
        return cls
    return add


def parse_value(text: str):
    """'0.8' -> 0.8, '4' -> 4, '[0.8;0.9]' -> [0.8, 0.9] (one value per row), 'none' -> None."""
    text = text.strip()
    if text.lower() == "none":
        return None
    if text.startswith("[") and text.endswith("]"):
        return [parse_value(t) for t in text[1:-1].split(";") if t.strip()]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise DecodeError(f"{text!r} is not a number") from None


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """'eb:gamma=0.01' -> ('eb', {'gamma': 0.01}); 'localleap:kappa=0.8,tau=0.7' -> two settings."""
    name, _, rest = spec.strip().partition(":")
    settings = {}
    for item in filter(None, (t.strip() for t in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise DecodeError(f"{spec!r}: expected name:setting=value,...; {item!r} has no '='")
        settings[key.strip()] = parse_value(value)
    return name.strip(), settings


def split_specs(text: str) -> list[str]:
    """A comma-separated list of rule specs, where a rule's own settings are also comma-separated:
    'localleap:kappa=0.8,tau=0.7,threshold' -> ['localleap:kappa=0.8,tau=0.7', 'threshold'].
    A piece holding '=' but no ':' continues the previous rule's settings."""
    specs: list[str] = []
    for piece in filter(None, (t.strip() for t in text.split(","))):
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def rule(name_or_spec, **settings):
    """A rule object from a name and settings, or from a spec string ('eb:gamma=0.01'); a rule object
    passes through (with `settings` applied)."""
    if not isinstance(name_or_spec, str):
        return dataclasses.replace(name_or_spec, **settings) if settings else name_or_spec
    name, parsed = parse_spec(name_or_spec)
    if name not in RULES:
        raise DecodeError(f"unknown strategy {name!r}; choose from {', '.join(sorted(RULES))}")
    settings = {**parsed, **settings}
    cls = RULES[name]
    known = set(settings_of(cls())) if dataclasses.is_dataclass(cls) else None
    unknown = sorted(set(settings) - known) if known is not None else []
    if unknown:
        raise DecodeError(f"{name} has no setting {', '.join(unknown)}; its settings: "
                          f"{', '.join(sorted(known)) or '(none)'}")
    return cls(**settings)


# ---------------------------------------------------------------- rules given as functions


@struct.dataclass
class FunctionRule(RuleBase):
    """A stateless rule given as a function `fn(signals) -> commit [B, T]` (see `stateless`)."""

    fn: Callable = struct.field(pytree_node=False)
    name: str = struct.field(pytree_node=False, default="stateless")

    def update(self, s: Signals, state):
        return self.fn(s), state


def stateless(fn: Callable[[Signals], Array], name: str | None = None) -> FunctionRule:
    """The special case: a rule with no state, from a pure function of the step's signals."""
    return FunctionRule(fn, name or getattr(fn, "__name__", "stateless"))


class RuleParams(NamedTuple):
    """The parameters of the old function form `fn(conf, candidates, p)` (deprecated)."""

    kappa: Any
    tau: Any
    radius: int
    quota: Int[Array, "B"]


@struct.dataclass
class LegacyRule(RuleBase):
    """An old-form rule `fn(conf [B, T], candidates [B, T], p: RuleParams) -> commit [B, T]`.

    Deprecated: its kappa/tau/radius are compile-time constants, as they were (every value compiles
    a program); new rules are dataclasses with traced settings."""

    fn: Callable = struct.field(pytree_node=False)
    name: str = struct.field(pytree_node=False, default="legacy")
    kappa: float = struct.field(pytree_node=False, default=0.9)
    tau: float = struct.field(pytree_node=False, default=0.75)
    radius: int = struct.field(pytree_node=False, default=4)
    steps: int | None = setting(None, int, low=1, none_ok=True)

    def update(self, s: Signals, state):
        return self.fn(s.conf, s.candidates, RuleParams(self.kappa, self.tau, self.radius, s.quota(self.steps))), state

    def spec(self) -> str:
        return f"{self.name}:kappa={self.kappa:g},radius={self.radius},tau={self.tau:g}" + (
            f",steps={self.steps}" if self.steps is not None else "")


def register(name: str):
    """Register a rule under `name`: a rule dataclass, a function of the step's signals, or (deprecated)
    a function of (conf, candidates, p: RuleParams)."""
    def add(obj):
        if inspect.isclass(obj):
            return register_rule(name)(obj)
        if name in RULES:
            raise ValueError(f"rule {name!r} is already registered")
        if len(inspect.signature(obj).parameters) == 3:
            RULES[name] = lambda **kw: LegacyRule(obj, name, **kw)
        else:
            RULES[name] = lambda **kw: dataclasses.replace(stateless(obj, name), **kw)
        return obj
    return add
