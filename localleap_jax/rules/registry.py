"""Rules by name: the registry, `rule("name:setting=value,...")`, rules given as functions, rules as JSON."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import numpy as np
from flax import struct
from jaxtyping import Array

from localleap_jax.rules.base import DecodeError, RuleBase, Signals, settings_of

class Registry(dict):
    """name -> rule class (or a factory taking the settings as keywords). A name not found is looked for in the
    installed packages' entry points (group `localleap_jax.rules`, see `rules.sources`) before it is refused."""

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or (isinstance(name, str) and _from_entry_points(name))

    def __missing__(self, name):
        if isinstance(name, str) and _from_entry_points(name):
            return dict.__getitem__(self, name)
        raise KeyError(name)

    def get(self, name, default=None):
        return self[name] if name in self else default


RULES: Registry = Registry()
# name -> (module, qualname) of what registered it: the same object registered again (a file loaded again, a
# notebook cell run again, importlib.reload) replaces its rule; another one under a taken name is refused.
ORIGINS: dict[str, tuple[str, str]] = {}
_LOGS: list[list[str]] = []  # names registered while a source runs (rules.sources listens here)


# What a name not found is looked for with before it is refused: rules.sources.from_entry_points, set there (the
# package imports it), so this module needs nothing of it.
ON_MISS: list = []


def _from_entry_points(name: str) -> bool:
    return any(look(name) for look in ON_MISS)


def origin_of(obj) -> tuple[str, str]:
    return (getattr(obj, "__module__", None) or "?", getattr(obj, "__qualname__", None) or repr(obj))


def _bad_name(name) -> str | None:
    if not isinstance(name, str) or not name or ":" in name or "," in name or "=" in name:
        return f"rule name {name!r}: a name is a non-empty string without ':', ',' or '='"
    return None


def _add(name: str, value, origin: tuple[str, str]) -> None:
    if _bad_name(name):
        raise ValueError(_bad_name(name))
    if dict.__contains__(RULES, name) and ORIGINS.get(name) != origin:
        module, qualname = ORIGINS.get(name, ("?", "?"))
        raise ValueError(f"rule {name!r} is already registered (by {qualname} in {module}); choose another name")
    dict.__setitem__(RULES, name, value)
    ORIGINS[name] = origin
    for log in _LOGS:
        log.append(name)


def note_registered(name: str) -> None:
    """Tell the sources listening (rules.sources) that something was registered under `name` (a cache policy, by
    decode.cache.registry: a user's file may register policies as well as rules)."""
    for log in _LOGS:
        log.append(name)


def unregister(name: str) -> None:
    """Forget a registered name (rules.sources does, before it runs a changed file again)."""
    dict.pop(RULES, name, None)
    ORIGINS.pop(name, None)


def register_rule(name: str):
    """Class decorator: make a rule dataclass reachable as `rule(name, **settings)`."""
    def add(cls):
        _add(name, cls, origin_of(cls))
        cls.name = name
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



def unknown_rule(name: str, what: str = "strategy") -> str:
    """The line for a rule name nobody registered: the closest registered names when there are any (a misspelling),
    else every name."""
    import difflib

    near = difflib.get_close_matches(name, RULES, n=3)
    if near:
        return f"unknown {what} {name!r}; did you mean {' or '.join(map(repr, near))}?"
    return f"unknown {what} {name!r}; choose from {', '.join(sorted(RULES))}"


def rule(name_or_spec, **settings):
    """A rule object from a name and settings, or from a spec string ('eb:gamma=0.01'); a rule object
    passes through (with `settings` applied). Checked when made (one DecodeError line)."""
    if not isinstance(name_or_spec, str):
        given = name_or_spec
        if isinstance(given, type) or not callable(getattr(given, "update", None)):
            what = f"the class {given.__name__} (pass an instance)" if isinstance(given, type) else \
                f"{type(given).__name__} {given!r:.40}"
            raise DecodeError(f"rule takes a rule name, a spec string ('eb:gamma=0.01') or a rule object; got {what}")
        if not settings:
            return given
        known = set(settings_of(given)) if dataclasses.is_dataclass(given) else set()
        unknown = sorted(set(settings) - known)
        if unknown:
            raise DecodeError(f"{getattr(given, 'name', type(given).__name__)} has no setting {', '.join(unknown)}; "
                              f"its settings: {', '.join(sorted(known)) or '(none)'}")
        made = dataclasses.replace(given, **settings)
        made.validate()
        return made
    name, parsed = parse_spec(name_or_spec)
    if name not in RULES:
        raise DecodeError(unknown_rule(name))
    settings = {**parsed, **settings}
    cls = RULES[name]
    known = set(settings_of(cls())) if dataclasses.is_dataclass(cls) else None
    unknown = sorted(set(settings) - known) if known is not None else []
    if unknown:
        raise DecodeError(f"{name} has no setting {', '.join(unknown)}; its settings: "
                          f"{', '.join(sorted(known)) or '(none)'}")
    made = cls(**settings)
    # Checked when made: every setting (None where it takes none), and what the rule asks of its settings together
    # (localleap's tau <= kappa); what depends on the canvas waits for DecodeConfig.
    validate = getattr(made, "validate", None)
    if callable(validate):
        validate()
    return made


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
    if not callable(fn):
        raise DecodeError(f"stateless takes a function of the step's signals (fn(signals) -> commit [B, T]); got "
                          f"{type(fn).__name__} {fn!r:.40}")
    if name is not None and _bad_name(name):
        raise DecodeError(_bad_name(name))
    return FunctionRule(fn, name or getattr(fn, "__name__", "stateless"))


def register(name: str):
    """Register a rule under `name`: a rule dataclass, or a function of the step's signals (a stateless rule
    with no settings)."""
    if _bad_name(name):
        raise DecodeError(f"{_bad_name(name)}; e.g. @ll.register(\"steady\")")

    def add(obj):
        if not callable(obj):
            raise DecodeError(f"register({name!r}) decorates a rule class or a function of the step's signals; got "
                              f"{type(obj).__name__} {obj!r:.40}")
        if inspect.isclass(obj):
            return register_rule(name)(obj)
        factory = lambda **kw: dataclasses.replace(stateless(obj, name), **kw)  # noqa: E731
        factory.function = obj  # what the rule's code is (rules.sources.code_identity)
        _add(name, factory, origin_of(obj))
        return obj
    return add


# ---------------------------------------------------------------- rules as JSON (exact settings)
# A spec string rounds floats to six digits (`spec()` formats with %g); JSON keeps every setting exact, so
# another process (localleap_jax.dist.multihost) rebuilds the very same rule.


def value_to_json(value):
    """A setting as JSON: a number as itself (Python's float repr round-trips exactly), an array of one
    value per row as {"rows": [...], "dtype": ...}."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr.item()
    return {"rows": arr.tolist(), "dtype": arr.dtype.name}


def value_from_json(value):
    if isinstance(value, dict):
        return np.asarray(value["rows"], dtype=value["dtype"])
    return value


def rule_to_json(rule) -> dict:
    """A rule object as JSON: a registered rule by name with every field's exact value, or a combinator
    of such rules. A rule that only exists as a Python object here (a function, an unregistered class)
    cannot be rebuilt elsewhere: DecodeError."""
    from localleap_jax.rules.combinators import AllOf, AnyOf

    if isinstance(rule, AnyOf):  # AllOf is an AnyOf
        return {"combinator": "all_of" if isinstance(rule, AllOf) else "any_of",
                "rules": [rule_to_json(r) for r in rule.rules]}
    name = getattr(rule, "name", None)
    if not dataclasses.is_dataclass(rule) or RULES.get(name) is not type(rule):
        raise DecodeError(f"rule {name or rule!r} cannot be sent to the other processes: a multi-process run "
                          "takes registered rules (ll.register) and any_of/all_of of them")
    return {"rule": name, "fields": {f.name: value_to_json(getattr(rule, f.name)) for f in dataclasses.fields(rule)}}


def rule_from_json(data: dict):
    from localleap_jax.rules.combinators import all_of, any_of

    if "combinator" in data:
        combine = {"any_of": any_of, "all_of": all_of}[data["combinator"]]
        return combine(*(rule_from_json(r) for r in data["rules"]))
    return RULES[data["rule"]](**{k: value_from_json(v) for k, v in data["fields"].items()})
