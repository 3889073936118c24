"""The per-request stats log: one JSON line per generated request (NFE, seconds, prompt and generated
tokens), keyed by its prompt, or per scored likelihood request (seconds, tokens, the estimate), appended after every batch and read back on a rerun. A request's answer is
cached only once its stats are on disk (see LocalLeapLM.generate_until)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from localleap_jax.lm_eval.args import ModelArgsError


def prompt_key(context: str) -> str:
    return hashlib.sha256(context.encode()).hexdigest()


def pair_key(context: str, continuation: str) -> str:
    """A likelihood request's key in the stats log (its context and continuation)."""
    return hashlib.sha256(json.dumps(["loglikelihood", context, continuation]).encode()).hexdigest()


def read_stats(path: Path) -> dict[str, dict]:
    """Per-request stats from the appended JSONL log, by prompt key.

    A record counts once its newline is written: a torn last record (the process was killed or the
    disk filled mid-write) is cut from the file, so the next append starts on a fresh line, and its
    request, never cached before its stats (see generate_until), is generated again. An unreadable
    complete line is skipped the same way."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
        print(f"note: {path}: dropped a torn last record; its request is generated again", file=sys.stderr)
    stats = {}
    for line in complete.splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(row, dict) and isinstance(row.get("key"), str):
            stats[row["key"]] = row
    return stats


def check_writable(path: Path) -> None:
    """Refuse a stats_path that cannot be appended to, leaving nothing behind (a refused run creates nothing)."""
    path = Path(path)
    created = next((p for p in (*reversed(path.parent.parents), path.parent) if not p.exists()), None)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        open(path, "a").close()
    except OSError as e:
        raise ModelArgsError(f"model_args stats_path: cannot write {path} ({e.strerror})") from None
    finally:
        if not existed and path.is_file():
            path.unlink()
        if created is not None and created.exists():
            shutil.rmtree(created, ignore_errors=True)


def open_stats(path: Path) -> dict[str, dict]:
    """The stats logged so far; checks now that the log can be written, not after the first batch."""
    check_writable(path)
    return read_stats(path)


def append_stats(path: Path, rows: list[dict]) -> None:
    """Append one batch's rows to the log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))  # one write: a torn record is the last one
