"""How an exception reads in one line: what every `error: ...` line of this project quotes."""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
