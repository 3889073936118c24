"""A rule's calls inside the compiled loop, and what went wrong in them, in one line.

`init` and `update` run while the loop is traced (once per compiled program, before anything runs): every signal
and setting is then an abstract array, so a rule that branches in Python on one (`if s.conf > 0.9:`), hands one
to NumPy, raises, or returns something the loop cannot carry fails inside JAX's tracing, far from its own code.
`run_init` and `run_update` make each of these one DecodeError line naming the rule, the file and line where it
failed (the deepest frame of the user's own code; else the rule's own file; else where its code is defined), and
what to do. `check_calls` refuses, before anything is loaded, an `init` or `update` that cannot take the
arguments the loop passes.
"""

from __future__ import annotations

import inspect
import os
import sysconfig
import traceback
from pathlib import Path

import jax
import numpy as np

from localleap_jax.errors import first_line
from localleap_jax.rules.base import Decision, DecodeError
from localleap_jax.rules.combinators import AnyOf
from localleap_jax.rules.registry import FunctionRule

LIBRARY = Path(__file__).resolve().parents[1]  # localleap_jax/
# Where code that is not the user's lives: this library, JAX, NumPy and every installed package, the standard library.
NOT_USER = (str(LIBRARY), *{str(Path(sysconfig.get_paths()[k]).resolve())
                            for k in ("stdlib", "platstdlib", "purelib", "platlib")})

TRACED = "inside the compiled loop every signal and setting is a traced array"


def decision_code(rule):
    """The function that holds the rule's decisions: a stateless rule's function, else its class's `update`."""
    fn = rule.fn if isinstance(rule, FunctionRule) else type(rule).update
    return inspect.unwrap(fn)


def _shown(filename: str) -> str:
    """A path as a user reads it: relative to the working directory when under it."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive
        return filename
    return filename if rel.startswith("..") else rel


def defined_at(rule, fn=None) -> str | None:
    """'file:line' where `fn` (default: the rule's decisions) is defined (None when Python keeps no code for it)."""
    code = getattr(inspect.unwrap(fn) if fn is not None else decision_code(rule), "__code__", None)
    return f"{_shown(code.co_filename)}:{code.co_firstlineno}" if code is not None else None


def label(rule, fn=None) -> str:
    """How a message names a rule: its name, and where its decisions (or `fn`) are defined ('steady' at
    myrules.py:12)."""
    where = defined_at(rule, fn)
    return f"{rule.name!r}" + (f" at {where}" if where else "")


def _is_users(filename: str) -> bool:
    path = str(Path(filename).resolve()) if not filename.startswith("<") else filename
    return not any(path == root or path.startswith(root + os.sep) for root in NOT_USER)


def failed_at(rule, error: BaseException, fn=None) -> str | None:
    """'file:line' of the failure: the deepest frame of the user's own code, else of the file the rule's code is in
    (a rule an installed package holds), else where the function that failed (`fn`; default: the rule's decisions)
    is defined."""
    frames = traceback.extract_tb(error.__traceback__)
    users = [f for f in frames if _is_users(f.filename)]
    code = getattr(decision_code(rule), "__code__", None)
    own = [f for f in frames if code is not None and f.filename == code.co_filename]
    frame = (users or own or [None])[-1]
    return f"{_shown(frame.filename)}:{frame.lineno}" if frame is not None else defined_at(rule, fn)


def explain(rule, method: str, error: BaseException, fn=None) -> str:
    """One line: the rule, where it failed, what happened and what to do."""
    where = failed_at(rule, error, fn)
    who = f"rule {rule.name!r}" + (f" at {where}" if where else "")
    if isinstance(error, jax.errors.TracerBoolConversionError):
        return (f"{who} branches in Python on a traced value (if, while, and, or, bool() on a signal or setting): "
                f"use jnp.where(condition, a, b); {TRACED}")
    if isinstance(error, jax.errors.TracerArrayConversionError):
        return f"{who} calls NumPy on a traced value: use jax.numpy (jnp) in {method}, not numpy; {TRACED}"
    if isinstance(error, jax.errors.TracerIntegerConversionError):
        return (f"{who} turns a traced value into a Python int (int(), range(), an index into a list): keep it an "
                f"array (jnp.arange, jnp.where, jnp.take); {TRACED}")
    if isinstance(error, jax.errors.ConcretizationTypeError):
        return f"{who} needs the value of a traced array (float(), a shape or a loop bound from it): {TRACED}"
    return f"{who} raised {type(error).__name__} in {method}: {first_line(error)}"


def _call(rule, method: str, fn, args: tuple, defined=None):
    """fn(*args), a failure in one line (`defined`: the function a failure outside every user frame is put at)."""
    try:
        return fn(*args)
    except DecodeError:  # already one line (the library's own checks, e.g. signals.held_out without probes)
        raise
    except Exception as e:  # noqa: BLE001 - the rule's code: any failure is reported in one line
        raise DecodeError(explain(rule, method, e, defined)) from None


def run_init(rule, batch: int, block: int, vocab: int):
    """`rule.init(batch, block, vocab)`, its failures in one line."""
    return _call(rule, "init", rule.init, (batch, block, vocab), defined=rule.init)


def run_update(rule, signals, state):
    """`rule.update(signals, state)` -> (commit or Decision, state), its failures in one line: an exception, and a
    result that is not a pair or a state the loop cannot carry (not the pytree, shapes and dtypes it was given)."""
    out = _call(rule, "update", rule.update, (signals, state))  # put at the rule's decisions (a function's own)
    if isinstance(out, Decision) or not isinstance(out, tuple) or len(out) != 2:
        what = ("a Decision alone" if isinstance(out, Decision) else f"a tuple of {len(out)}" if isinstance(out, tuple)
                else f"an array {tuple(out.shape)}" if hasattr(out, "shape") else type(out).__name__)
        raise DecodeError(f"rule {label(rule)} returned {what} from update; expected a pair (commit, state): "
                          "return commit, state (a rule with no state returns the state it was given)")
    check_state(rule, state, out[1])
    return out


def run_temperature(rule, step):
    """A canvas rule's `temperature(step)` -> [B], its failures in one line."""
    out = _call(rule, "temperature", rule.temperature, (step,), defined=rule.temperature)
    if not hasattr(out, "shape") or tuple(out.shape) != tuple(step.shape):
        raise DecodeError(f"rule {label(rule, rule.temperature)} returned {type(out).__name__} from temperature(step); "
                          f"expected an array {tuple(step.shape)} (one temperature per row)")
    return out


def _leaf(x) -> str:
    return f"{np.dtype(jax.numpy.result_type(x)).name}{list(np.shape(x))}"


def check_state(rule, given, returned) -> None:
    """The state update returns is what the loop carries to the next pass: the pytree init built, leaf for leaf of
    the same shape and dtype."""
    fix = "return the state as init builds it (the same pytree, shapes and dtypes)"
    if jax.tree.structure(given) != jax.tree.structure(returned):
        raise DecodeError(f"rule {label(rule)} returned a state of another structure than init's "
                          f"({type(returned).__name__} of {len(jax.tree.leaves(returned))} arrays; init gave "
                          f"{type(given).__name__} of {len(jax.tree.leaves(given))}): {fix}")
    for i, (a, b) in enumerate(zip(jax.tree.leaves(given), jax.tree.leaves(returned))):
        if np.shape(a) != np.shape(b) or jax.numpy.result_type(a) != jax.numpy.result_type(b):
            raise DecodeError(f"rule {label(rule)} returned a state whose array {i} is {_leaf(b)}, not "
                              f"{_leaf(a)}: {fix}")


def _binds(fn, n: int) -> bool:
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        return True
    return True


def check_calls(rule) -> None:
    """Refuse, in one line, a rule whose init or update cannot take the loop's arguments (and a combinator's
    sub-rule that cannot)."""
    if isinstance(rule, AnyOf):
        for r in rule.rules:
            check_calls(r)
    if isinstance(rule, FunctionRule):
        if not _binds(rule.fn, 1):
            raise DecodeError(f"rule {label(rule)}: a stateless rule's function takes the step's signals alone, "
                              f"fn(s) -> commit; its signature is {inspect.signature(rule.fn)}")
        return
    for method, fn, args in (("init", rule.init, "(batch, block, vocab)"), ("update", rule.update, "(signals, state)")):
        if not _binds(fn, args.count(",") + 1):
            raise DecodeError(f"rule {label(rule, fn)}: {method}{inspect.signature(fn)} cannot take the loop's call "
                              f"{method}{args}")


__all__ = ["check_calls", "check_state", "defined_at", "explain", "label", "run_init", "run_temperature",
           "run_update"]
