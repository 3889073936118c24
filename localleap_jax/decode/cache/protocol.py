"""What a cache policy is to the loop: the protocol, what a pass is told and tells back, settings and traits.

    state = policy.init(denoiser, canvas)                                 # before the first pass
    hidden = policy.forward(denoiser, canvas, x, block, state, view)      # this pass: what it computes
    state = policy.update(denoiser, hidden.cache, outcome)                # after the rule's step: what it saw
    state = policy.refill(denoiser, canvas, state, rows)                  # a slot takes its next prompt

`forward` decides, per row, what the pass computes (the whole canvas, a window, a subset of positions, a partial
recompute per layer) from the view of the rows before it (`PassView`) and what the policy keeps; `update` sees
what the pass did (`PassOutcome`: the canvas before and after, the step's predictions, confidences and commits,
which rows move to their next block) and schedules the next pass (dKV-Cache's delayed caching, d2Cache's picks,
vicinity's pass counter, DiffusionGemma's self-conditioning input): one optax-like mechanism for all of them.
Every decision is per row: a row's pass depends on its own schedule and canvas only, never on the other rows of
the batch, so a row decodes as it does alone and a slot refills as soon as its row finishes.

A policy is a frozen dataclass holding its settings. Numeric settings (`setting(...)`) are traced, one value per
row (`with_rows`), like a rule's: a sweep over them compiles once, and one batch can hold rows with different
settings. A setting that fixes a shape (a window's width, how many positions a pass recomputes) is static
(`static_setting(...)`): part of the compiled program.

Traits (class attributes, read once, never probed):
  fits       the kinds of attention the policy approximates or keeps exactly: "bidirectional" (LLaDA, Dream,
             LLaDA-MoE), "block_causal" (SDAR, Fast-dLLM v2, LLaDA2), "canvas" (a uniform-noise canvas model)
  computes   what a pass computes, in words ("canvas", "block", "window", "positions", "layers")
  keeps      what the policy keeps between passes ("nothing", "kv", "kv+sublayer outputs", "encoder kv")
  refreshes  when what it keeps is renewed ("every pass", "block start", "schedule", "never")
  region     True: every pass can give the hidden states of the whole generated region (a rule that sees the
             generated region, a trace's predictions outside the block)
  attention_weights  True: the policy's own pass computes attention probabilities (d2Cache's rollout); no other
             program computes them
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Protocol

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.decode.canvas import Block, Canvas, rows_take
from localleap_jax.rules.base import DecodeError, check_settings, make_spec, setting

__all__ = ["CachePolicy", "Hidden", "PassOutcome", "PassView", "PolicyBase", "from_full", "setting",
           "static_setting"]


class PassView(NamedTuple):
    """What the loop knows of each row before a pass."""

    done: Bool[Array, "B"]  # rows that finished (their slot may be empty): nothing of theirs is read
    starting: Bool[Array, "B"]  # the row's first pass in its block (with free tokens: its block's store pass)
    block: Int[Array, "B"]  # the row's current block (0, 1, ...)
    step: Int[Array, "B"]  # passes the row has worked in its block
    want_region: bool = False  # static: the caller wants the region's hidden states (a trace, a region rule)
    # The loop's prediction for hidden states a policy computed (its scoring and special ids, greedy):
    # hidden [B, N, D] -> (pred [B, N], conf [B, N]). d2Cache ranks by the first pass's confidences.
    score: Callable | None = None


class Hidden(NamedTuple):
    block: Float[Array, "B T D"]  # the hidden states that predict each row's current block
    region: Float[Array, "B G D"] | None  # those that predict the generated region (asked for and computed)
    cache: Any  # the policy's state after this pass (before `update`)
    held_out: Float[Array, "B T D"] | None = None  # the block's probe copy (ProbedNoCache): each position hidden
    full: Bool[Array, "B"] | None = None  # rows that ran the whole canvas this pass (None: none did)


class PassOutcome(NamedTuple):
    """What a pass did, for the policy to schedule the next one."""

    canvas: Canvas  # the rows' layout (prompt length, mask id, ...)
    before: Int[Array, "B L"]  # the canvas at the pass's input
    after: Int[Array, "B L"]  # the canvas after the step's commits (and remasks, edits; before an early-stop fill)
    block: Block  # each row's block of the pass (before any row moves on)
    step: Any  # the step's StepResult over the rule's region: pred, conf, code (commits), working, finished, scaled
    region_idx: Int[Array, "B R"]  # canvas indices of the step's region
    done: Bool[Array, "B"]  # rows finished after this pass
    advance: Bool[Array, "B"]  # rows that move to their next block after this pass


class CachePolicy(Protocol):
    name: str
    fits: tuple[str, ...]
    computes: str
    keeps: str
    refreshes: str
    region: bool
    attention_weights: bool

    def init(self, denoiser, canvas: Canvas) -> Any: ...

    def forward(self, denoiser, canvas: Canvas, x: Int[Array, "B L"], block: Block, state: Any, view: PassView
                ) -> Hidden: ...

    def update(self, denoiser, state: Any, outcome: PassOutcome) -> Any: ...

    def refill(self, denoiser, canvas: Canvas, state: Any, rows: Bool[Array, "B"]) -> Any: ...

    def with_rows(self, batch: int) -> "CachePolicy": ...

    def static(self) -> "CachePolicy": ...

    def validate(self, gen_length: int | None = None, block_length: int | None = None) -> "CachePolicy": ...

    def spec(self) -> str: ...


def static_setting(default, kind: type = int, *, low=None, high=None, low_open: bool = False, none_ok: bool = False):
    """A setting that fixes a shape of the program (a window's width, a count of positions): compiled in, the
    same for every row."""
    return struct.field(pytree_node=False, default=default,
                        metadata={"setting": (kind, low, high, low_open, none_ok), "static": True})


def _fields(policy, static: bool):
    return [f for f in dataclasses.fields(policy) if "setting" in f.metadata and f.metadata.get("static", False) == static]


class PolicyBase:
    """Defaults of a cache policy dataclass (decorate with `flax.struct.dataclass`): no settings checks beyond their
    ranges, nothing to do after a pass or for a new prompt, the spec string, per-row settings."""

    name: ClassVar[str]
    fits: ClassVar[tuple[str, ...]] = ("bidirectional",)
    computes: ClassVar[str] = "canvas"
    keeps: ClassVar[str] = "nothing"
    refreshes: ClassVar[str] = "every pass"
    region: ClassVar[bool] = False
    attention_weights: ClassVar[bool] = False

    def init(self, denoiser, canvas):
        return ()

    def update(self, denoiser, state, outcome):
        return state

    def refill(self, denoiser, canvas, state, rows):
        return state

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if "setting" in f.metadata}

    def validate(self, gen_length: int | None = None, block_length: int | None = None):
        """Raise DecodeError for a setting the policy cannot run with (before anything compiles)."""
        try:
            check_settings(self)
        except DecodeError as e:
            raise DecodeError(f"cache {e}") from None
        for f in _fields(self, static=True):
            if np.ndim(getattr(self, f.name)) > 0:
                raise DecodeError(f"cache {self.name}: {f.name} fixes a shape of the program: one value for the "
                                  "whole batch, not one per row")
        return self

    def with_rows(self, batch: int):
        """This policy with every traced setting an array of shape [batch] (int32 or float32)."""
        out = {}
        for f in _fields(self, static=False):
            value = getattr(self, f.name)
            if value is None:
                continue
            arr = np.asarray(value)
            if arr.ndim == 1 and arr.shape[0] != batch:
                raise DecodeError(f"cache {self.name}: {f.name} has {arr.shape[0]} values for a batch of {batch} rows")
            kind = f.metadata["setting"][0]
            out[f.name] = np.broadcast_to(arr, (batch,)).astype(np.int32 if kind is int else np.float32)
        return dataclasses.replace(self, **out)

    def static(self):
        """What the compiled program's key holds of this policy: its class and static settings (the traced ones are
        inputs of the program)."""
        return dataclasses.replace(self, **{f.name: None for f in _fields(self, static=False)})

    def spec(self) -> str:
        """'name:setting=value,...' with every setting: parses back with `ll.cache(...)`."""
        return make_spec(self.name, self.settings())


def from_full(h_all: Float[Array, "B L D"], canvas: Canvas, block: Block, want_region: bool):
    """From a whole-canvas pass: the hidden states that predict the block, and (if wanted) the region."""
    P, L, shift = canvas.prompt_length, canvas.length, canvas.shift
    h_block = rows_take(h_all, block.idx - shift if shift else block.idx)
    return h_block, h_all[:, P - shift:L - shift] if want_region else None


def per_row(x: Array, like: Array) -> Array:
    """A [B] setting shaped to broadcast against `like` [B, ...]."""
    x = jnp.asarray(x)
    return x.reshape(x.shape + (1,) * (like.ndim - 1)) if x.ndim == 1 else x
