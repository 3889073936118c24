"""Every error this library raises for a mistake a user can fix, under one base, and how one reads in one line.

    try:
        model = ll.load(path)
    except ll.LocalLeapError as e:       # any of the classes below
        print(f"error: {first_line(e)}")

Each class also keeps the builtin base it always had (ValueError for bad input, RuntimeError for what broke
underneath), so code that caught those still does. A command line prints any of them as one `error: ...` line.
"""

from __future__ import annotations


class LocalLeapError(Exception):
    """The base of every error the library raises on purpose (input it cannot run, a run it cannot finish)."""


class ConfigError(LocalLeapError, ValueError):
    """A config.json this package cannot run faithfully."""


class TokenizerError(LocalLeapError, ValueError):
    """A tokenizer that cannot be used with its model."""


class PromptTypeError(TokenizerError, TypeError):
    """A prompt that is not text (None, bytes, token ids) or a batch that is not a list of prompts: also a TypeError,
    as it always was."""


class TraceError(LocalLeapError, ValueError):
    """A trace file that cannot be written or read (an unwritable path, a missing or foreign file)."""


class DecodeError(LocalLeapError, ValueError):
    """A decoding configuration or input that cannot run."""


class RulesError(DecodeError):
    """A rule source that cannot be loaded (no such file or module, a failing import, no rule registered)."""


class CheckpointError(LocalLeapError, ValueError):
    """A checkpoint directory that is missing, incomplete or does not match its config."""


class ConversionError(LocalLeapError, RuntimeError):
    """Anything about a Hugging Face source that stops a faithful conversion; the message says what."""


class LikelihoodError(LocalLeapError, ValueError):
    """A likelihood request or setting that cannot be served (said in one line, before any work)."""


class DistributedError(LocalLeapError, ValueError):
    """The processes cannot be set up as asked (flags, environment, a coordinator that never answered)."""


class LostProcessError(LocalLeapError, RuntimeError):
    """Another process of the run died or stopped answering in the middle of a collective."""


class ModelArgsError(LocalLeapError, ValueError):
    """Model arguments (`--model_args` or LocalLeapLM keywords) that name no setting or hold a bad value."""


class CacheMismatchError(LocalLeapError, ValueError):
    """A response cache written by another model or decoding setup."""


class UserError(LocalLeapError):
    """A mistake in a command line or its inputs: reported in one line."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
