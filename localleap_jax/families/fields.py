"""Typed readers of config.json fields, shared by the family readers.

JSON gives ints, floats, bools and null; a wrong type or range is named, never coerced (int(64.7) would silently
build a different model). Absent and null both mean "the family's default", when it has one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from localleap_jax.errors import ConfigError


def whole(cfg: Mapping, key: str, default: Any = None, minimum: int = 1) -> int:
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(f"config.json is missing {key}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json {key}={value!r} must be an integer")
    if value < minimum:
        raise ConfigError(f"config.json {key}={value} must be >= {minimum}")
    return value


def positive(cfg: Mapping, key: str, default: float | None) -> float:
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(f"config.json is missing {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config.json {key}={value!r} must be a positive number")
    return float(value)


def flag(cfg: Mapping, key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config.json {key}={value!r} must be true or false")
    return value


def refuse(bad: list[str]) -> None:
    """One ConfigError naming every feature a config.json asks for that the network does not implement."""
    if bad:
        raise ConfigError("config.json asks for features this model does not implement: " + ", ".join(bad))


def fill_token_id(hf_config: dict, key: str, src: Path, token: str) -> None:
    """config.json's `key` (a mask or EOS id it does not name) from the source's tokenizer files: the id of the
    added token `token` in tokenizer.json, else in the slow layout's added_tokens.json; one ConfigError if neither
    has it. A key config.json gives is kept."""
    if hf_config.get(key) is not None:
        return
    from localleap_jax.tokenizer import added_token_id

    found = added_token_id(src / "tokenizer.json", token)
    if found is None:
        try:
            found = json.loads((src / "added_tokens.json").read_text()).get(token)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            found = None
    if not isinstance(found, int):
        raise ConfigError(f"config.json has no {key} and {src}/tokenizer.json has no {token} token: set {key} in "
                          "config.json")
    hf_config[key] = found
