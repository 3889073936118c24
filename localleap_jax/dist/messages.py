"""What process 0 sends the others: load, generate and stop messages, packed as arrays and broadcast.

A message is broadcast from process 0 with `multihost_utils.broadcast_one_to_all` in two parts: a
fixed-size header (kind, shapes, lengths) and then the arrays it announces (prompt ids and mask, the
request as JSON, the random key's data). The DecodeConfig travels as JSON with the rule's settings as exact
numbers (per-row arrays included; `DecodeConfig.to_json`): a rule spec string would round floats to six
digits (`rule.spec()` formats with %g).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

import numpy as np

from localleap_jax.errors import first_line
from localleap_jax.processes import LostProcessError

MAGIC = 0x4C4C4D48  # "LLMH": a follower running another version of this protocol stops at once
KINDS = ("stop", "load", "generate", "loglikelihood")
HEADER_WORDS = 8  # magic, kind, rows, cols, json bytes, key words, status, reserved
JSON_QUANTUM = 512  # JSON is padded to a multiple of this: fewer distinct broadcast shapes to compile


@dataclasses.dataclass
class Message:
    """What the leader asks of the followers. `meta` is JSON: load: path, dtype, mesh, verify;
    generate: config, trace, key_impl, mesh, rules (the files or modules the rule's code comes from, with the
    sha256 of their bytes: `rules.sources.sources_of`; a follower loads them first); loglikelihood: likelihood
    (LikelihoodConfig), lengths (continuation tokens per request: each row of `ids` is its context then its
    continuation), greedy, mesh; stop: nothing (the status travels in the header)."""

    kind: str
    meta: dict = dataclasses.field(default_factory=dict)
    ids: np.ndarray | None = None  # [B, P] int32
    mask: np.ndarray | None = None  # [B, P] bool
    key: np.ndarray | None = None  # the random key's data, uint32
    status: int = 0  # stop: the leader's exit status


def pack(msg: Message) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(header int32[HEADER_WORDS], the arrays it announces) for one message."""
    text = json.dumps(msg.meta, sort_keys=True).encode() if msg.meta else b""
    rows, cols = msg.ids.shape if msg.ids is not None else (0, 0)
    key = None if msg.key is None else np.asarray(msg.key, np.uint32).reshape(-1)
    header = np.array([MAGIC, KINDS.index(msg.kind), rows, cols, len(text), 0 if key is None else key.size,
                       msg.status, 0], np.int32)
    payload = {}
    if text:
        padded = -(-len(text) // JSON_QUANTUM) * JSON_QUANTUM
        payload["json"] = np.frombuffer(text.ljust(padded, b" "), np.uint8).copy()
    if rows:
        payload["ids"] = np.asarray(msg.ids, np.int32)
        payload["mask"] = np.asarray(msg.mask, bool).astype(np.uint8)
    if key is not None:
        payload["key"] = key
    return header, payload


def payload_template(header: np.ndarray) -> dict[str, np.ndarray]:
    """Zero arrays of the shapes a header announces (what a follower passes to the broadcast)."""
    check_header(header)
    _, _, rows, cols, n_json, n_key, _, _ = (int(v) for v in header)
    payload = {}
    if n_json:
        payload["json"] = np.zeros(-(-n_json // JSON_QUANTUM) * JSON_QUANTUM, np.uint8)
    if rows:
        payload["ids"] = np.zeros((rows, cols), np.int32)
        payload["mask"] = np.zeros((rows, cols), np.uint8)
    if n_key:
        payload["key"] = np.zeros(n_key, np.uint32)
    return payload


def check_header(header: np.ndarray) -> None:
    header = np.asarray(header)
    if header.shape != (HEADER_WORDS,) or int(header[0]) != MAGIC or not 0 <= int(header[1]) < len(KINDS):
        raise LostProcessError("process 0 sent a message this process cannot read (are all processes running "
                               "the same version of localleap_jax?)")


def unpack(header: np.ndarray, payload: dict[str, np.ndarray]) -> Message:
    check_header(header)
    _, kind, rows, _, n_json, _, status, _ = (int(v) for v in header)
    meta = json.loads(bytes(np.asarray(payload["json"], np.uint8))[:n_json]) if n_json else {}
    return Message(KINDS[kind], meta, ids=payload["ids"] if rows else None,
                   mask=payload["mask"].astype(bool) if rows else None, key=payload.get("key"), status=status)


# ---------------------------------------------------------------- transports


class Transport(Protocol):
    """Carries a pytree of host arrays from process 0 to every process (shapes known to all)."""

    def send(self, tree: Any) -> None: ...

    def receive(self, template: Any) -> Any: ...


class BroadcastTransport:
    """`multihost_utils.broadcast_one_to_all`: a psum over every device of every process, in which
    only process 0 contributes (gloo on CPU, NCCL/ICI on accelerators)."""

    def send(self, tree):
        self._broadcast(tree, True)

    def receive(self, template):
        return self._broadcast(template, False)

    @staticmethod
    def _broadcast(tree, is_source: bool):
        import jax
        from jax.experimental import multihost_utils

        try:
            return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)
        except jax.errors.JaxRuntimeError as e:
            raise LostProcessError(f"lost contact with the other processes: one of them has died or cannot be "
                                   f"reached ({first_line(e)})") from None


def send(transport: Transport, msg: Message) -> None:
    header, payload = pack(msg)
    transport.send(header)
    if payload:
        transport.send(payload)


def receive(transport: Transport) -> Message:
    header = np.asarray(transport.receive(np.zeros(HEADER_WORDS, np.int32)))
    template = payload_template(header)
    payload = transport.receive(template) if template else {}
    return unpack(header, {k: np.asarray(v) for k, v in payload.items()})


__all__ = ["BroadcastTransport", "HEADER_WORDS", "KINDS", "MAGIC", "Message", "Transport", "check_header", "pack",
           "payload_template", "receive", "send", "unpack"]
