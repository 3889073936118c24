"""What the answers depend on: the identity of the weights, the tokenizer and every decoding setting that
changes tokens (`answers_key`), and the response cache claimed by the setup that wrote it, so answers of
another model or setting are never reused."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from localleap_jax.errors import CacheMismatchError
from localleap_jax.checkpoint import Model, params_fingerprint
from localleap_jax.decode import DecodeConfig
from localleap_jax.hashing import sha256_files, sha256_json
from localleap_jax.rules.sources import code_digest
from localleap_jax.tokenizer import TOKENIZER_FILES

ENCODING_FILES = tuple(f for f in TOKENIZER_FILES if f != "generation_config.json")  # what decides token ids
CACHE_OWNER = "localleap_jax/answers_key"  # the entry of a response cache naming the setup that wrote it


def decode_settings(cfg: DecodeConfig) -> dict:
    """What in the DecodeConfig changes tokens: its fields, the rule's every setting (not prompt_bucket:
    left padding, which attention masks out) and the rule's code (`rules.code_identity`: its class or function,
    the module that defines it, the library's version), so an edited rule is generated again."""
    return {**cfg.fingerprint(), "rule_code": code_digest(cfg.rule)}


def rows_interact(cfg: DecodeConfig) -> bool:
    """Whether a row's tokens depend on which rows share its batch: sampling draws one key per batch, and a canvas
    rule's draws follow a row's place in its batch (decode/draws.py). (Every cache policy decides per row, so a
    row's tokens do not depend on the others: tests/test_decode_vs_torch.py, tests/test_field_caches.py.)"""
    return cfg.draws


@functools.lru_cache(maxsize=8)
def _checkpoint_fingerprint(path: str, manifest_stamp: tuple) -> str:
    return params_fingerprint(path)


def weights_fingerprint(model: Model) -> str:
    """Content identity of the weights: the checkpoint's params_fingerprint (recorded at conversion,
    else hashed from its files once per process), or a hash of the arrays of a model built in memory."""
    if model.path is not None:
        path = Path(model.path).resolve()
        st = os.stat(path / "manifest.json")  # a replaced checkpoint has a new manifest: never a stale memo
        return _checkpoint_fingerprint(str(path), (st.st_ino, st.st_mtime_ns, st.st_size))
    h = hashlib.sha256()
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        leaf = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(keypath)}{leaf.dtype}{leaf.shape}".encode())
        h.update(leaf.tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(model: Model) -> str:
    """Hash of the files that decide token ids (the tokenizer, its config and chat template)."""
    if model.path is not None:
        files = [Path(model.path) / name for name in ENCODING_FILES if (Path(model.path) / name).is_file()]
        if files:
            return sha256_files(files, names=True)
    hf = model.tokenizer.hf
    return sha256_json([hf.backend_tokenizer.to_str(), hf.chat_template, hf.special_tokens_map])


def answers_key(model: Model, cfg: DecodeConfig, *, chat: bool, seed: int, truncate_fewshot: bool | str,
                batch: dict, task: dict | None = None, likelihood: dict | None = None) -> dict:
    """Everything the generated answers depend on, as a JSON-able dict; its digest names a resume cache.

    `batch`: what decides which requests share a batch (batch size, device count, the requests run),
    counted only when rows of a batch change each other's tokens. `task`: what the caller knows of the
    prompts (the data, the number of few-shot examples). `likelihood`: the estimator's settings, for the
    log-likelihood answers the same cache holds. Nothing else belongs here: not where the
    checkpoint or the output lives, not settings that only change speed."""
    key = {
        "weights": weights_fingerprint(model),
        "model_config": dataclasses.asdict(model.config),
        "tokenizer": tokenizer_fingerprint(model),
        "dtype": str(model.dtype),
        "decode": decode_settings(cfg),
        "chat": bool(chat),
        "truncate_fewshot": truncate_fewshot,
    }
    if cfg.draws:  # greedy decoding with a masked rule draws no random numbers
        key["seed"] = seed
    if rows_interact(cfg):
        key["batch"] = batch
    if task:
        key["task"] = task
    if likelihood:
        key["likelihood"] = likelihood
    return key


key_digest = sha256_json  # the digest of an answers_key: what names a resume cache


def _differences(found: Any, wanted: Any, where: str = "") -> list[str]:
    if isinstance(found, dict) and isinstance(wanted, dict):
        return [d for k in sorted(set(found) | set(wanted), key=str)
                for d in _differences(found.get(k), wanted.get(k), f"{where}.{k}" if where else str(k))]
    return [] if found == wanted else [where or "key"]


def claim_cache(db, key: dict) -> None:
    """Mark an lm-eval response cache as this setup's, or refuse one another setup wrote."""
    found = db.get(CACHE_OWNER)
    if found is None and len(db):  # written before caches were claimed: whose answers they are is unknown
        raise CacheMismatchError(f"the response cache {getattr(db, 'filename', '')} holds answers with no record of "
                                 "the model and settings that wrote them; delete it or use another --use_cache path")
    if found is None:
        db[CACHE_OWNER] = key
        db.commit()
    elif found != key:
        raise CacheMismatchError(f"the response cache {getattr(db, 'filename', '')} holds answers of another setup "
                                 f"({', '.join(_differences(found, key))} differ); use another --use_cache path")


def response_cache_file(prefix: str | Path, rank: int = 0) -> Path:
    """The file lm-eval keeps a response cache in for `use_cache=prefix` (its rank's)."""
    return Path(f"{prefix}_rank{rank}.db")


def check_response_cache(path: str | Path) -> None:
    """Refuse, in one line naming it, a response cache file SQLite cannot read whole (a truncated or overwritten
    file): lm-eval's cache writer would fail in a thread of its own, with a traceback and no file named. A missing
    file is fine (lm-eval creates it)."""
    import sqlite3

    path = Path(path)
    if not path.is_file():
        return
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            verdict = conn.execute("PRAGMA quick_check").fetchone()
    except sqlite3.DatabaseError as e:
        verdict = (f"sqlite3.{type(e).__name__}: {e}",)
    if verdict != ("ok",):
        raise CacheMismatchError(f"the response cache {path} is damaged ({verdict[0]}); delete it and rerun (the "
                                 "answers it held are generated again)")


def forget_missing_answers(db) -> int:
    """Delete cache entries that hold no answer (an old failure stored None), so they are generated again."""
    empty = [k for k, v in db.items() if v is None]
    for k in empty:
        del db[k]
    if empty:
        db.commit()
    return len(empty)
