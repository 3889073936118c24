"""Recorders: what the loop writes down about each pass besides the canvas.

    state = recorder.init(batch, gen_length, passes, edits, indels)
    state = recorder.update(state, head, hidden_region, region, step, nfe, scoring, special)   # every pass
    trace = recorder.to_host(state, x, nfe, prompt_length, clause_names, remask_names, edit_names)   # after the loop

`NoRecorder` carries nothing (the program holds no trace buffers); `TraceRecorder` fills the static buffers
of `localleap_jax.trace.Trace`. `wants_region` asks the cache policy for the hidden states of the whole
generated region, which the trace scores at every pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, Protocol

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from localleap_jax.decode.canvas import Region
from localleap_jax.decode.step import Scoring, StepResult, predict
from localleap_jax.denoiser import SpecialIds
from localleap_jax.trace import FORCED, Trace


class Recorder(Protocol):
    wants_region: bool

    def init(self, batch: int, gen_length: int, passes: int, edits: bool = False, indels: bool = False) -> Any: ...

    def update(self, state: Any, head, hidden_region: Float[Array, "B G D"] | None, region: Region, step: StepResult,
               nfe: Int[Array, "B"], prompt_length: int, scoring: Scoring, special: SpecialIds) -> Any: ...

    def to_host(self, state: Any, x: np.ndarray, nfe: np.ndarray, prompt_length: int,
                clause_names: tuple[str, ...], remask_names: tuple[str, ...] = (),
                edit_names: tuple[str, ...] = ()) -> Trace | None: ...


@dataclasses.dataclass(frozen=True)
class NoRecorder:
    wants_region: ClassVar[bool] = False

    def init(self, batch, gen_length, passes, edits=False, indels=False):
        return ()

    def update(self, state, head, hidden_region, region, step, nfe, prompt_length, scoring, special):
        return state

    def to_host(self, state, x, nfe, prompt_length, clause_names, remask_names=(), edit_names=()):
        return None


class TraceBuffers(NamedTuple):
    """Per-pass records inside the loop (see trace.py)."""

    pred: Int[Array, "B S G"]
    conf: Float[Array, "B S G"]
    clause: Int[Array, "B S G"]
    commit_pass: Int[Array, "B G"]
    edit: Any = ()  # [B, S, G] int8 edit codes (a rule that edits; else (): not in the program)
    indel: Any = ()  # [B, S, G] int8: 1 a position dropped, 2 one inserted (a rule that rewrites; else ())


@dataclasses.dataclass(frozen=True)
class TraceRecorder:
    """Each row's pass s (its NFE before the pass) goes to slot s: a row's trace does not depend on the others."""

    wants_region: ClassVar[bool] = True

    def init(self, batch, gen_length, passes, edits=False, indels=False):
        B, G, S = batch, gen_length, passes
        return TraceBuffers(jnp.full((B, S, G), -1, jnp.int32), jnp.full((B, S, G), jnp.nan, jnp.float32),
                            jnp.zeros((B, S, G), jnp.int8), jnp.full((B, G), -1, jnp.int32),
                            jnp.zeros((B, S, G), jnp.int8) if edits else (),
                            jnp.zeros((B, S, G), jnp.int8) if indels else ())

    def update(self, state, head, hidden_region, region, step, nfe, prompt_length, scoring, special):
        B, G = state.commit_pass.shape
        S = state.pred.shape[1]
        rows = jnp.arange(B)[:, None]
        if hidden_region is not None:
            region_pred, region_conf, _ = predict(head(hidden_region), scoring._replace(temperature=0.0), special,
                                                  None)
        else:  # the pass computed only the block
            region_pred = jnp.full((B, G), -1, jnp.int32)
            region_conf = jnp.full((B, G), jnp.nan, jnp.float32)
        at = region.idx - prompt_length
        # A block-diffusion row's block may start in the prompt or reach past gen_length (its grid's tail):
        # those positions are not in the trace (index G is dropped).
        at = jnp.where((at >= 0) & (at < G), at, G)
        # Inside the block, record exactly what the rule saw (sampled predictions included).
        region_pred = region_pred.at[rows, at].set(step.pred, mode="drop")
        region_conf = region_conf.at[rows, at].set(step.conf, mode="drop")
        # commits as their clause codes k > 0, remasks as -k (k: the rule's remask clause); a position committed
        # and taken back in the same pass (Saber may) is recorded as the remask, what the pass left there
        code = step.code if step.remask is None else jnp.where(step.remask > 0, -step.remask, step.code)
        region_code = jnp.zeros((B, G), jnp.int8).at[rows, at].set(code, mode="drop")
        s = jnp.minimum(nfe, S - 1)

        def keep(buf, new):  # only working rows write their slot
            return buf.at[rows[:, 0], s].set(jnp.where(step.working[:, None], new, buf[rows[:, 0], s]))

        commit_pass = jnp.where(region_code > 0, nfe[:, None], state.commit_pass)
        edit = state.edit
        if step.edit is not None:  # edits, a clause of their own: codes k > 0 (edit_names[k - 1]) in their buffer
            edit = keep(edit, jnp.zeros((B, G), jnp.int8).at[rows, at].set(step.edit, mode="drop"))
        indel = state.indel
        if step.insert is not None or step.delete is not None:  # where the pass dropped / inserted a position
            marks = jnp.zeros(step.code.shape, jnp.int8)
            for k, m in ((1, step.delete), (2, step.insert)):
                marks = marks if m is None else jnp.where(m, jnp.int8(k), marks)
            indel = keep(indel, jnp.zeros((B, G), jnp.int8).at[rows, at].set(marks, mode="drop"))
        return TraceBuffers(keep(state.pred, region_pred), keep(state.conf, region_conf),
                            keep(state.clause, region_code), commit_pass, edit, indel)

    def to_host(self, state, x, nfe, prompt_length, clause_names, remask_names=(), edit_names=()):
        clause = np.asarray(state.clause)
        G = clause.shape[2]
        return Trace(pred=np.asarray(state.pred), conf=np.asarray(state.conf), committed=clause > 0, clause=clause,
                     clause_names=tuple(clause_names) + (FORCED,),  # the last: a commit only the loop's contract made
                     token=np.asarray(x)[:, prompt_length:prompt_length + G],
                     commit_pass=np.asarray(state.commit_pass), passes=np.asarray(nfe),
                     remask_names=tuple(remask_names),
                     edit=None if isinstance(state.edit, tuple) else np.asarray(state.edit),
                     edit_names=tuple(edit_names),
                     indel=None if isinstance(state.indel, tuple) else np.asarray(state.indel))
