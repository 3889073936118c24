"""Cache policies by name: the registry, `cache("name:setting=value,...")`, a user's policy, policies as JSON.

    ll.cache("dkv", reload_every=8)             # == ll.cache("dkv:reload_every=8")
    ll.DecodeConfig(..., cache="dllm_cache:gen_interval=4")      # a spec string is the same policy
    @ll.register_cache("mine")                  # a user's policy class (a flax struct dataclass, PolicyBase)

A user's file registers its policies when it is loaded the way a user's rules are (`--rules path/to/mine.py`, or
`ll.rules.load_rules(...)`): every command then takes `--cache mine:setting=...`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from localleap_jax.errors import DecodeError
from localleap_jax.rules import registry as rule_registry
from localleap_jax.rules.registry import parse_spec, value_from_json, value_to_json

CACHES: dict[str, type] = {}
_ORIGINS: dict[str, tuple[str, str]] = {}
SPECIAL = ("auto",)  # not a policy: the model's own choice (DecodeConfig.cache_mode)


def register_cache(name: str):
    """Class decorator: make a cache policy dataclass reachable as `cache(name, **settings)` (and by every command's
    --cache). The same class registered again (a file loaded again) replaces it; another one under a taken name is
    refused."""
    def add(cls):
        if not isinstance(name, str) or not name or any(ch in name for ch in ":,=+"):
            raise ValueError(f"cache name {name!r}: a non-empty string without ':', ',', '=' or '+'")
        origin = rule_registry.origin_of(cls)
        if name in CACHES and _ORIGINS.get(name) != origin:
            raise ValueError(f"cache {name!r} is already registered (by {_ORIGINS[name][1]} in {_ORIGINS[name][0]}); "
                             "choose another name")
        CACHES[name] = cls
        _ORIGINS[name] = origin
        cls.name = name
        rule_registry.note_registered(f"cache {name}")  # a user's source that registers a policy registers something
        return cls
    return add


def known() -> str:
    return ", ".join(["auto", *CACHES])


def cache(name_or_spec, **settings):
    """A cache policy from a name and settings, or from a spec string ('dkv:reload_every=8'); a policy object
    passes through (with `settings` applied). Unknown names and settings are one DecodeError line."""
    if not isinstance(name_or_spec, str):
        if not is_policy(name_or_spec):
            raise DecodeError(f"cache={name_or_spec!r} is not a cache policy: give a name ({known()}), a spec such as "
                              "'dkv:reload_every=8', or ll.cache(...)")
        return dataclasses.replace(name_or_spec, **settings) if settings else name_or_spec
    try:
        name, parsed = parse_spec(name_or_spec)
    except DecodeError as e:
        raise DecodeError(f"cache {e}") from None
    if name not in CACHES:
        near = difflib.get_close_matches(name, ["auto", *CACHES], n=1)
        raise DecodeError(f"unknown cache {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                          + f"; choose from {known()}")
    cls = CACHES[name]
    settings = {**parsed, **settings}
    declared = {f.name for f in dataclasses.fields(cls) if "setting" in f.metadata}
    unknown = sorted(set(settings) - declared)
    if unknown:
        raise DecodeError(f"cache {name} has no setting {', '.join(unknown)}; its settings: "
                          f"{', '.join(sorted(declared)) or '(none)'}")
    return cls(**settings)


def is_policy(obj) -> bool:
    return all(hasattr(obj, a) for a in ("name", "init", "forward", "update", "refill", "with_rows", "static",
                                         "validate", "spec", "fits"))


def resolve(value):
    """The policy a DecodeConfig's `cache` names ("auto" stays "auto": the model decides), validated: one
    DecodeError line for anything else."""
    if isinstance(value, str) and value.strip() in SPECIAL:
        return value.strip()
    if not isinstance(value, str) and not is_policy(value):
        missing = [a for a in ("name", "init", "forward", "update", "refill", "with_rows", "static", "validate",
                               "spec", "fits") if not hasattr(value, a)]
        what = type(value).__name__
        raise DecodeError(f"cache={value!r} is not a cache policy ({what} has no {', '.join(missing)}): give a name "
                          f"({known()}), a spec such as 'dkv:reload_every=8', or ll.cache(...)")
    policy = cache(value)
    return policy.validate()


def policy_to_json(policy) -> Any:
    """A policy as JSON with its exact settings ("auto" as itself)."""
    if isinstance(policy, str):
        return policy
    if CACHES.get(policy.name) is not type(policy):
        raise DecodeError(f"cache {policy.name!r} cannot be sent to the other processes: a multi-process run takes "
                          "registered cache policies (ll.register_cache)")
    return {"cache": policy.name, "fields": {f.name: value_to_json(getattr(policy, f.name))
                                              for f in dataclasses.fields(policy) if "setting" in f.metadata}}


def policy_from_json(data):
    if isinstance(data, str):
        return resolve(data)
    return CACHES[data["cache"]](**{k: value_from_json(v) for k, v in data["fields"].items()})
