"""The per-pass trace of a generation, and its compact file form.

`generate(..., trace=True)` records, inside the one compiled loop, what the model predicted at every
position of the generated region at every forward pass of each row, and what the rule committed.
Pass s of a row is that row's own s-th forward pass (its NFE count before the pass), so a row's
trace does not depend on the other rows of its batch when they advance independently.

Shapes: B rows, S = gen_length (the static bound on passes: every working row commits at least one
token per pass), G = gen_length positions. Entries past a row's `passes`, and positions the pass did
not compute (with a KV cache only the window the pass ran has predictions), hold pred -1 and conf NaN.

A trace file (`save_trace`) is one compressed .npz holding the arrays (cut to the longest row's
passes), the clause names, the decoded texts and a JSON dict of whatever the caller wants kept
beside them (model, strategy, prompts), so the analyses run later without the model.
"""

from __future__ import annotations

import json
import zipfile
from os import PathLike
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np
from jaxtyping import Bool, Float, Int

from localleap_jax.errors import TraceError, first_line


# The last clause name of every trace from the loop: a commit only the loop's contract made (a working row whose
# rule chose nothing commits its most confident candidate). Distinct from a rule's own "top1" clause.
FORCED = "forced"


class Trace(NamedTuple):
    pred: Int[np.ndarray, "B S G"]  # prediction at each generated position at pass s (-1: not computed)
    conf: Float[np.ndarray, "B S G"]  # its confidence (softmax probability), NaN where not computed
    committed: Bool[np.ndarray, "B S G"]  # the position took its prediction at pass s
    clause: Int[np.ndarray, "B S G"]  # 0: not committed at s; k > 0: committed by clause_names[k - 1]
    clause_names: tuple[str, ...]  # the rule's clause names ("commit" when it does not say), then FORCED
    token: Int[np.ndarray, "B G"]  # the final generated tokens
    commit_pass: Int[np.ndarray, "B G"]  # the pass at which each position committed; -1: never (early-stop fill)
    passes: Int[np.ndarray, "B"]  # valid passes per row (its NFE)
    remask_names: tuple[str, ...] = ()  # a rule that takes commits back: clause == -k is remask_names[k - 1]
    # A rule that edits: edits are a clause of their own, edit[b, s, g] == k > 0 where pass s replaced the token at
    # g by a different one, by edit_names[k - 1] (a commit of a mask is never an edit); None for a rule that does not
    edit: Int[np.ndarray, "B S G"] | None = None
    edit_names: tuple[str, ...] = ()
    # A rule that rewrites its block (LLaDA2.2's insert/delete): indel[b, s, g] == k > 0 where pass s dropped (k = 1,
    # INDEL_NAMES[0]) or inserted (k = 2) a position at g (positions of the block before the pass); None otherwise
    indel: Int[np.ndarray, "B S G"] | None = None

    @property
    def remasked(self) -> Bool[np.ndarray, "B S G"]:
        """True where a decoded position was taken back (masked again) at pass s."""
        return self.clause < 0

    @property
    def edited(self) -> Bool[np.ndarray, "B S G"]:
        """True where pass s replaced the position's token by a different one (all False for a rule that never edits)."""
        return np.zeros(self.clause.shape, bool) if self.edit is None else self.edit > 0

    @property
    def deleted(self) -> Bool[np.ndarray, "B S G"]:
        """True where pass s dropped the position (LLaDA2.2's DELETE; all False for other rules)."""
        return np.zeros(self.clause.shape, bool) if self.indel is None else self.indel == 1

    @property
    def inserted(self) -> Bool[np.ndarray, "B S G"]:
        """True where pass s inserted a mask before the position's token (LLaDA2.2's SPLIT; all False otherwise)."""
        return np.zeros(self.clause.shape, bool) if self.indel is None else self.indel == 2

    @property
    def masked(self) -> Bool[np.ndarray, "B S G"]:
        """True where the position was still masked when pass s ran (it was a candidate prediction). From each
        position's last commit: for a rule that takes commits back (`remasked`), a revoked position's earlier
        spells as a token are not told apart here."""
        s = np.arange(self.pred.shape[1])[None, :, None]
        cp = self.commit_pass[:, None, :]
        return (s <= cp) & (cp >= 0) | (cp < 0) & (s < self.passes[:, None, None])

    def row(self, b: int) -> "Trace":
        """Row b alone, with its passes only (S cut to passes[b])."""
        n = int(self.passes[b])
        return Trace(self.pred[b:b + 1, :n], self.conf[b:b + 1, :n], self.committed[b:b + 1, :n],
                     self.clause[b:b + 1, :n], self.clause_names, self.token[b:b + 1], self.commit_pass[b:b + 1],
                     self.passes[b:b + 1], self.remask_names, None if self.edit is None else self.edit[b:b + 1, :n],
                     self.edit_names, None if self.indel is None else self.indel[b:b + 1, :n])


_ARRAYS = ("pred", "conf", "committed", "clause", "token", "commit_pass", "passes")


def save_trace(path: str | Path, trace: Trace, texts: Sequence[str] | None = None,
               meta: dict[str, Any] | None = None) -> Path:
    """Write one compressed .npz: the arrays (S cut to the longest row), clause names, texts and meta."""
    if isinstance(path, Trace) and not isinstance(trace, Trace):
        raise TraceError("save_trace(path, trace, ...): the path comes first, then out.trace")
    if not isinstance(path, (str, PathLike)):
        raise TraceError(f"save_trace takes a file path (str or Path), got {type(path).__name__} {path!r:.40}")
    if not isinstance(trace, Trace):
        raise TraceError(f"save_trace takes a Trace (out.trace of ll.generate(..., trace=True)), got "
                         f"{type(trace).__name__}" + (" (generate ran without trace=True)" if trace is None else ""))
    path = Path(path)
    S = max(int(np.max(trace.passes, initial=0)), 1)
    arrays = {name: np.asarray(getattr(trace, name)) for name in _ARRAYS}
    for name in ("edit", "indel"):
        if getattr(trace, name) is not None:
            arrays[name] = np.asarray(getattr(trace, name))
    for name in ("pred", "conf", "committed", "clause", "edit", "indel"):
        if name in arrays:
            arrays[name] = arrays[name][:, :S]
    extra = {"clause_names": list(trace.clause_names), "remask_names": list(trace.remask_names), "texts": list(texts) if texts is not None else None,
             "meta": meta or {}, "edit_names": list(trace.edit_names)}
    blob = json.dumps(extra).encode()  # a text or meta JSON cannot hold is named before any file is made
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:  # a file object: numpy would otherwise append .npz to other suffixes
            np.savez_compressed(f, **arrays, extra=np.frombuffer(blob, np.uint8))
    except OSError as e:
        raise TraceError(f"cannot write the trace to {path}: {e.strerror or type(e).__name__}") from None
    return path


def load_trace(path: str | Path) -> tuple[Trace, list[str] | None, dict[str, Any]]:
    """(trace, texts, meta) from a file written by `save_trace`; one TraceError line for a file that is missing or is
    not one."""
    if not isinstance(path, (str, PathLike)):
        raise TraceError(f"load_trace takes a file path (str or Path), got {type(path).__name__} {path!r:.40}")
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"no trace file at {path}" + (" (a directory)" if path.is_dir() else ""))
    foreign = f"{path} is not a trace file written by save_trace"
    try:
        archive = np.load(path, allow_pickle=False)
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror or first_line(e)}") from None
    except (ValueError, EOFError, zipfile.BadZipFile):  # numpy's own text suggests allow_pickle: not for a trace
        raise TraceError(f"{foreign} (not a NumPy .npz archive)") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise TraceError(f"{foreign} (a single .npy array, not an .npz archive)")
    try:
        with archive as z:
            missing = [n for n in (*_ARRAYS, "extra") if n not in z.files]
            if missing:
                raise TraceError(f"{foreign} (it lacks {', '.join(missing)})")
            extra = json.loads(bytes(z["extra"]).decode())
            trace = Trace(pred=z["pred"], conf=z["conf"], committed=z["committed"], clause=z["clause"],
                          clause_names=tuple(extra["clause_names"]), token=z["token"], commit_pass=z["commit_pass"],
                          passes=z["passes"], remask_names=tuple(extra.get("remask_names", ())),
                          edit=z["edit"] if "edit" in z.files else None, edit_names=tuple(extra.get("edit_names", ())),
                          indel=z["indel"] if "indel" in z.files else None)
            return trace, extra["texts"], extra["meta"]
    except TraceError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile) as e:
        raise TraceError(f"{foreign} (damaged: {type(e).__name__}: {first_line(e)})") from None
