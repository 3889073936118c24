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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json give it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_token_ids(src: Path) -> dict[str, dict[str, int]]:
    """Every added token's id, by the file that says it: tokenizer.json (its added tokens), tokenizer_config.json (its
    added_tokens_decoder) and added_tokens.json, the files a release may hold (a fast tokenizer, the slow layout, or
    both: SDAR's spell the same id <|MASK|> in the first two and <MASK> in the third)."""
    out: dict[str, dict[str, int]] = {}
    fast = _read_json(src / "tokenizer.json")
    if isinstance(fast, Mapping) and isinstance(fast.get("added_tokens"), list):
        out["tokenizer.json"] = {t["content"]: t["id"] for t in fast["added_tokens"]
                                 if isinstance(t, Mapping) and isinstance(t.get("content"), str)
                                 and isinstance(t.get("id"), int)}
    decoder = (_read_json(src / "tokenizer_config.json") or {})
    decoder = decoder.get("added_tokens_decoder") if isinstance(decoder, Mapping) else None
    if isinstance(decoder, Mapping):
        out["tokenizer_config.json"] = {_token_text(t): int(i) for i, t in decoder.items()
                                        if str(i).isdigit() and _token_text(t) is not None}
    added = _read_json(src / "added_tokens.json")
    if isinstance(added, Mapping):
        out["added_tokens.json"] = {t: i for t, i in added.items() if isinstance(i, int) and not isinstance(i, bool)}
    return out


def tokenizer_role(src: Path, role: str) -> str | None:
    """The token a tokenizer names for a role ("mask_token", "eos_token", ...): tokenizer_config.json's, else
    special_tokens_map.json's."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        found = _read_json(src / name)
        text = _token_text(found.get(role)) if isinstance(found, Mapping) else None
        if text is not None:
            return text
    return None


def fill_token_id(hf_config: dict, key: str, src: Path, token: str, *, spellings: tuple[str, ...] = (),
                  role: str | None = None) -> None:
    """config.json's `key` (a mask or EOS id it does not name) from the source's tokenizer files (tokenizer_token_ids):
    the id of the added token `token` (or one of its other `spellings`), else of the token the tokenizer names for
    `role` ("mask_token"). Files that give different ids are refused, and so is a source where none gives one (one
    ConfigError each). A key config.json gives is kept."""
    if hf_config.get(key) is not None:
        return
    files = tokenizer_token_ids(src)
    names = (token, *spellings)
    found = {(f, t): ids[t] for f, ids in files.items() for t in names if t in ids}
    if not found and role is not None:
        named = tokenizer_role(src, role)
        if named is not None:
            found = {(f, named): ids[named] for f, ids in files.items() if named in ids}
    if len(set(found.values())) > 1:
        said = ", ".join(f"{f} {t}={i}" for (f, t), i in found.items())
        raise ConfigError(f"config.json has no {key} and {src}'s tokenizer files disagree on it ({said}): set {key} "
                          "in config.json")
    if not found:
        raise ConfigError(f"config.json has no {key} and {src}'s tokenizer files (tokenizer.json, tokenizer_config.json, "
                          f"added_tokens.json) name no {' or '.join(names)} token: set {key} in config.json")
    hf_config[key] = next(iter(found.values()))
