"""What every decoding rule shares: the step's signals, the rule protocol, settings, clause codes.

A rule decides, once per forward pass, which still-masked positions of each row's current block
take their prediction. It is a frozen dataclass holding its own settings, with optax-style pure
functions:

    state = rule.init(batch, block, vocab)              # per-row state, leading axis B
    commit, state = rule.update(signals, state)         # commit [B, T]: bool, or int8 clause codes

`commit` may be a bool mask, or int8 clause codes (0: no commit, k: committed by
`rule.clause_names[k - 1]`) when the rule can say why it committed a position (traces and
statistics use them). The loop keeps the contract whatever the rule returns: only candidates
commit, and each working row commits at least one (its most confident candidate, where the rule
chose none). It resets a row's
state when the row enters a new block.

A rule that takes commits back returns `Decision(commit, remask)` instead: `remask` (bool, or int8 codes
naming `rule.remask_names`) marks positions of its region to mask again. The loop applies the commits, then
the remasks, and only ever remasks a position that holds a token (decoded before this pass or committed by it;
never a prompt position, never one outside the region); a working row that neither commits nor remasks
commits its most confident candidate. A rule that returns a bare commit compiles to the program without any
of it.

A rule that edits (LLaDA2.1's JointThreshold) returns `Decision(commit, edit=edit)`: `edit` (bool, or int8 codes
naming `rule.edit_names`) marks positions whose held token is replaced by this pass's prediction. The loop
applies an edit only where the position held a generated token before the pass (never a mask, never the prompt,
never outside the region, never a position the same pass remasks) and the prediction differs from it, so every
applied edit replaces a token by a different one (`out.edits` counts them; commits of masks are not edits).
A rule that decides when its row's block ends (`ends_blocks`) also returns `Decision(..., finished=[B] bool)`:
the loop ends a row's block on the pass whose decision says finished, once no position of it is masked, instead
of on the pass that fills its last mask; the passes in between, with no mask left, are working passes (NFE).

A rule that writes tokens other than the pass's predictions where they were predicted (`rewrites`: dInfer's credit
decoder writes the argmax of its fused logits; LLaDA2.2's insert/delete moves tokens inside the block) returns
`Decision(commit, ..., block=...)`: `block` [B, T] is the region as the rule wants it after this pass, and the loop
writes it in place of the predictions at the commits and edits (only where the rule may touch: never the prompt,
never outside the region, never a row that is done). The commit codes still say which masks the pass decoded (the
loop's contract holds: a working row whose rule commits nothing commits its most confident candidate's
prediction); the edit codes which held tokens it replaced by others (counted as given); `insert` / `delete` ([B, T]
bool, positions of the region before the pass) where it inserted a position or dropped one (`out.inserts`,
`out.deletes`).

A rule that feeds the next pass an input embedding (`soft_input`: dInfer's iteration smoothing) returns
`Decision(commit, soft_weight=w)`, w [B]: the next pass's input at every generated position still masked after
this pass is the token embedding plus w times the embedding this pass's distribution there expects
(softmax(logits) @ E); the loop runs the whole canvas every pass for it (cache "none" on a bidirectional model).

Class attributes a rule declares (all static; `RuleBase` gives the defaults, `traits.traits_of` reads them once
into the loop's compile-time settings):
  region        "block" (the current block; the default) or "generated": the generated region up to the current
                block's end (Saber, ReMDM). The signals cover the region, and the block ends only when no
                position of the region is masked.
  probes        True: the pass also scores every position of the block with its own position hidden (a masked
                copy of the block appended to the canvas, WINO's verification), as `signals.held_out`.
  remask_names  names of the remask clauses (non-empty: the rule revokes).
  resets_state  False: the loop keeps the rule's state when a row enters a new block (Saber's threshold history).
  edit_names    names of the edit clauses (non-empty: the rule edits held tokens; `Decision.edit`).
  ends_blocks   True: the rule says when its row's block is finished (`Decision.finished`), so a block may run
                passes after its last mask is filled (JointThreshold's post-edit passes). Its rows advance
                through blocks on their own (no cache shared by the batch's rows), and its `pass_bound` says how
                many passes a row may take.
  canvas        True: a canvas rule, for a uniform-noise canvas model without masks (DiffusionGemma): it accepts
                positions of a noisy canvas, the loop re-noises the rest (`rules.canvas`: its signals, its
                `CanvasDecision`, its `temperature(step)`).
  rewrites      True: the rule returns the region it wants written (`Decision.block`, above).
  soft_input    True: the rule weighs an input embedding for the next pass (`Decision.soft_weight`, above).

A rule is an object with every member of the `Rule` protocol below. Subclass `RuleBase` (and decorate with
`flax.struct.dataclass`), or give a function to `stateless`: an object of a class of your own that lacks a member
(a `region`, `spec`, `with_rows`, ...) is refused in one line naming what it lacks, not probed for defaults.

Settings are traced, per row. Every numeric setting is a pytree leaf: `generate` turns each into
an array of shape [B] (a scalar is broadcast), so the compiled program does not depend on their
values (a sweep compiles once) and one batch can hold rows with different settings. Inside
`update` a setting is therefore an array [B]; `per_row(x)` makes it broadcast against [B, T].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.errors import DecodeError

State = Any  # a pytree whose leaves have a leading batch axis; () for stateless rules


# ---------------------------------------------------------------- the step's signals


class Signals:
    """What one forward pass knows about each position of every row's region (its current block, or for a rule
    with region "generated" the generated region up to the block's end).

    `pred`, `conf` and `candidates` are always there, at every position of the region, committed ones too (the
    prediction there and its confidence); the distribution-derived signals are computed (in fp32) only when a
    rule reads them: an attribute nobody touches never enters the program. `logits` are the region's fp32
    scores after LLaDA's switches (EOS/EOT at -inf when the config says so), the distribution every
    confidence-like signal comes from. `tokens` is what the region holds before this pass, `valid` which of its
    positions the rule may touch (all of a block; of the generated region, those up to the block's end).
    """

    def __init__(self, *, logits: Float[Array, "B T V"], pred: Int[Array, "B T"], conf: Float[Array, "B T"],
                 candidates: Bool[Array, "B T"], step: Int[Array, "B"], gen_length: int, block_length: int,
                 num_blocks: Int[Array, "B"] | int | None = None, tokens: Int[Array, "B T"] | None = None,
                 valid: Bool[Array, "B T"] | None = None, mask_id: int | None = None,
                 held_out_logits: Float[Array, "B T V"] | None = None, idx: Int[Array, "B T"] | None = None,
                 prompt_length: int = 0, vocab_limit: int | None = None, delete_id: int | None = None,
                 split_id: int | None = None):
        self.logits = logits
        self.pred = pred
        self.conf = conf
        self.candidates = candidates
        self.step = step  # passes this row has already worked in its current block
        self.gen_length = gen_length
        self.block_length = block_length
        # Blocks each row decodes: gen_length // block_length, or per row on a block-diffusion grid (canvas.py).
        self.num_blocks = gen_length // block_length if num_blocks is None else num_blocks
        self.tokens = tokens
        self._valid = valid
        self.mask_id = mask_id
        self._held_out_logits = held_out_logits
        self._idx = idx  # canvas indices of the region's positions (positions < prompt_length are the prompt)
        self._prompt_length = prompt_length
        self.vocab_limit = vocab_limit  # ids >= this are never written (the tokenizer cannot decode them); None: all
        self.delete_id, self.split_id = delete_id, split_id  # the model's edit tokens (LLaDA2.2), None: it has none

    def writable(self, logits: Float[Array, "B T V"]) -> Float[Array, "B T V"]:
        """`logits` with the ids no rule may write (past the tokenizer's vocabulary) at -inf, for an argmax of a rule's
        own (the mask id stays: a rule that writes its own tokens decides what to do where the mask wins)."""
        V = logits.shape[-1]
        if self.vocab_limit is None or self.vocab_limit >= V:
            return logits
        return jnp.where(jnp.arange(V) < self.vocab_limit, logits, -jnp.inf)

    @property
    def valid(self) -> Bool[Array, "B T"]:
        return jnp.ones(self.conf.shape, bool) if self._valid is None else self._valid

    @functools.cached_property
    def prompt(self) -> Bool[Array, "B T"]:
        """Positions of the region that belong to the prompt: a block-diffusion row's first block holds its
        prompt's tail (never on a bidirectional model's blocks, which start after the prompt)."""
        if self._idx is None:
            return jnp.zeros(self.conf.shape, bool)
        return self._idx < self._prompt_length

    @property
    def decoded(self) -> Bool[Array, "B T"]:
        """Positions of the region that hold a generated token (what a rule may remask or edit): not a mask, not
        the prompt."""
        held = self.valid & (self.tokens != self.mask_id)
        return held if self._idx is None else held & ~self.prompt

    @functools.cached_property
    def held_conf(self) -> Float[Array, "B T"]:
        """The probability of the token each position holds (ReMDM ranks by it); the mask id at a masked one."""
        logp = jax.nn.log_softmax(self.logits, axis=-1)
        return jnp.exp(jnp.take_along_axis(logp, self.tokens[..., None], axis=-1)[..., 0])

    @functools.cached_property
    def held_out(self) -> Float[Array, "B T"]:
        """For a rule with `probes`: the probability of the token each block position holds, scored with that
        position hidden (WINO's verification: a masked copy of the block appended to the canvas)."""
        if self._held_out_logits is None:
            raise DecodeError("signals.held_out needs a rule with probes = True (the loop computes it only then)")
        logp = jax.nn.log_softmax(self._held_out_logits, axis=-1)
        return jnp.exp(jnp.take_along_axis(logp, self.tokens[..., None], axis=-1)[..., 0])

    @functools.cached_property
    def probs(self) -> Float[Array, "B T V"]:
        return jax.nn.softmax(self.logits, axis=-1)

    @functools.cached_property
    def margin(self) -> Float[Array, "B T"]:
        """Top-1 minus top-2 probability."""
        top2 = jax.lax.top_k(self.probs, 2)[0]
        return top2[..., 0] - top2[..., 1]

    @functools.cached_property
    def entropy(self) -> Float[Array, "B T"]:
        """-sum p log p in nats (0 log 0 = 0)."""
        logp = jax.nn.log_softmax(self.logits, axis=-1)
        return -jnp.sum(jnp.where(self.probs > 0, self.probs * logp, 0.0), axis=-1)

    def quota(self, steps: Int[Array, "B"] | int | None) -> Int[Array, "B"]:
        """LLaDA's get_num_transfer_tokens: how many tokens this step commits when `steps` steps (in
        total over the canvas) decode it; block_length is spread over the block's steps, remainder first.
        The steps per block are steps // num_blocks (a block-diffusion row may decode one block more than
        another: its blocks get as many steps each). None means one token per step."""
        T = self.block_length
        if steps is None:
            return jnp.ones(self.step.shape, jnp.int32)
        per_block = jnp.maximum(jnp.asarray(steps, jnp.int32) // jnp.asarray(self.num_blocks, jnp.int32), 1)
        base, remainder = T // per_block, T % per_block
        return (base + (self.step < remainder)).astype(jnp.int32)


# ---------------------------------------------------------------- small array helpers


def per_row(x) -> Array:
    """A setting (scalar or [B]) shaped to broadcast against [B, T]."""
    x = jnp.asarray(x)
    return x[:, None] if x.ndim == 1 else x


def most_confident(conf: Float[Array, "B T"], candidates: Bool[Array, "B T"]) -> Bool[Array, "B T"]:
    """One-hot of each row's most confident candidate (lowest index on ties); empty if none."""
    best = jnp.argmax(jnp.where(candidates, conf, -jnp.inf), axis=-1)
    return candidates & (jnp.arange(conf.shape[-1]) == best[:, None])


def rank_by(score: Float[Array, "B T"], candidates: Bool[Array, "B T"]) -> Int[Array, "B T"]:
    """Each candidate's rank by `score`, highest first (0 = best), lowest index first on ties;
    non-candidates rank after every candidate."""
    keyed = jnp.where(candidates, score, -jnp.inf)
    order = jnp.argsort(-keyed, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def top_k(score: Float[Array, "B T"], candidates: Bool[Array, "B T"], k: Int[Array, "B"]) -> Bool[Array, "B T"]:
    """The k best candidates of each row by `score` (k per row)."""
    return candidates & (rank_by(score, candidates) < per_row(k))


def first_clause(*clauses: Bool[Array, "B T"]) -> Int[Array, "B T"]:
    """int8 clause codes: k where clauses[k - 1] is the first clause that holds, 0 where none does."""
    code = jnp.zeros(clauses[0].shape, jnp.int8)
    for k in range(len(clauses), 0, -1):
        code = jnp.where(clauses[k - 1], jnp.int8(k), code)
    return code


# ---------------------------------------------------------------- settings


def setting(default, kind: type = float, *, low=None, high=None, low_open: bool = False,
            none_ok: bool = False):
    """A numeric setting: a traced pytree leaf, validated against [low, high] (or (low, high])."""
    return struct.field(default=default, metadata={"setting": (kind, low, high, low_open, none_ok)})


def settings_of(rule) -> dict[str, Any]:
    return {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule) if "setting" in f.metadata}


# What a setting may hold when a rule is made by hand: a user's values. A rule is also rebuilt from other leaves (JAX
# unflattens it with tracers, device arrays or placeholders while it compiles, shards or maps it; a placement reshapes
# its rows per device, [devices, rows]): those are not checked at construction, only by `validate` (which generate
# runs on the user's rule).
_USER_VALUES = (str, bytes, bool, int, float, list, tuple, np.ndarray, np.generic)


def _made_by_hand(value) -> bool:
    return isinstance(value, _USER_VALUES) and not (isinstance(value, np.ndarray) and value.ndim > 1)


def check_settings(rule, *, made: bool = False) -> None:
    """Every setting is a number, or an array of one per row, of the right kind and inside its range. `made=True`
    (a rule's construction): only the settings that hold a user's values are checked (see _USER_VALUES), and None
    passes (`validate` refuses it where the setting takes none)."""
    for f in dataclasses.fields(rule):
        if "setting" not in f.metadata:
            continue
        kind, low, high, low_open, none_ok = f.metadata["setting"]
        value = getattr(rule, f.name)
        if value is None and (none_ok or made) or isinstance(value, jax.core.Tracer):
            continue
        if made and not _made_by_hand(value):
            continue
        where = f"{rule.name}: {f.name}={value!r}"
        try:
            if value is None or isinstance(value, (str, bytes)) or np.asarray(value).dtype == bool:
                raise TypeError
            values = np.atleast_1d(np.asarray(value, dtype=np.float64))
        except (TypeError, ValueError):
            raise DecodeError(f"{where} must be a number (or an array of one per row)") from None
        if np.ndim(value) > 1:
            raise DecodeError(f"{rule.name}: {f.name} must be a number or one value per row (shape [B]), "
                              f"got shape {np.shape(value)}")
        with np.errstate(invalid="ignore"):
            wrong = ~np.isfinite(values)
            if kind is int:
                wrong |= values != np.round(values)
            if low is not None:
                wrong |= values <= low if low_open else values < low
            if high is not None:
                wrong |= values > high
        if not wrong.any():
            continue
        v = values[np.argmax(wrong)]  # the first value that fails, named as the user wrote it where possible
        shown = value if isinstance(value, (int, float)) else f"{v:g}"
        what = (f"{rule.name}: {f.name}={shown}" if np.ndim(value) == 0
                else f"{rule.name}: {f.name} holds {v:g}, which")
        if not np.isfinite(v):
            raise DecodeError(f"{what} must be finite")
        if kind is int and v != round(v):
            raise DecodeError(f"{what} must be a whole number")
        lo = "(-inf" if low is None else (f"({low:g}" if low_open else f"[{low:g}")
        hi = "inf)" if high is None else f"{high:g}]"
        raise DecodeError(f"{what} must lie in {lo}, {hi}")


def check_steps(rule, steps, gen_length: int | None, block_length: int | None) -> None:
    """LLaDA's schedule needs a whole number of steps per block, and no step that commits nothing."""
    if gen_length is None or block_length is None or isinstance(steps, jax.core.Tracer):
        return
    num_blocks = gen_length // block_length
    for s in np.atleast_1d(np.asarray(steps)).tolist():
        if s % num_blocks:
            raise DecodeError(f"{rule.name}: steps={s} is not a positive multiple of the number of blocks "
                              f"({num_blocks})")
        if s > gen_length:
            raise DecodeError(f"{rule.name}: steps={s} > gen_length={gen_length}: some steps would commit nothing")


def check_grid_steps(rule, blocks: int, gen_length: int, block_length: int) -> None:
    """On a block grid a rule's `steps` (the total over a row's decoded blocks) must give each of the `blocks` a row
    decodes at most (it depends on the prompts: decode/config.py's grid_blocks) a step."""
    steps = getattr(rule, "steps", None)  # a setting of the rules on LLaDA's schedule
    if steps is None:
        return
    low = int(np.min(np.asarray(steps)))
    if low < blocks:
        raise DecodeError(f"{rule.name}: steps={low} < the {blocks} blocks a row decodes (gen_length {gen_length} "
                          f"on the model's grid of {block_length}): every block needs a step")


def settings_as_rows(rule, batch: int) -> dict[str, np.ndarray]:
    """Every (non-None) setting as an array of shape [batch], int32 or float32: the traced form."""
    out = {}
    for f in dataclasses.fields(rule):
        value = getattr(rule, f.name)
        if "setting" not in f.metadata or value is None:
            continue
        arr = np.asarray(value)
        if arr.ndim == 1 and arr.shape[0] != batch:
            raise DecodeError(f"{rule.name}: {f.name} has {arr.shape[0]} values for a batch of {batch} rows")
        out[f.name] = np.broadcast_to(arr, (batch,)).astype(np.int32 if f.metadata["setting"][0] is int else np.float32)
    return out


def _format(v) -> str:
    arr = np.asarray(v)
    if arr.ndim == 0:
        x = arr.item()
        return f"{x:g}" if isinstance(x, float) else str(x)
    return "[" + ";".join(_format(x) for x in arr) + "]"


def make_spec(name: str, settings: dict[str, Any]) -> str:
    """'name:setting=value,...' (sorted; None settings left out): the string form `rule()` parses."""
    items = sorted((k, v) for k, v in settings.items() if v is not None)
    return name + (":" + ",".join(f"{k}={_format(v)}" for k, v in items) if items else "")


class Decision(NamedTuple):
    """What a rule that takes commits back, edits, ends its own blocks, rewrites its block or feeds the next pass
    returns: commits, remasks and edits over its region (bool or int8 codes; None: the rule never does that), which
    rows' blocks are finished after this pass ([B] bool; None: a block ends when its last mask fills), the region
    as the rule writes it ([B, T] ids), where it inserted and dropped positions ([B, T] bool), the weight of the next
    pass's input embedding ([B] float). Each field that is not None needs its trait: remask_names, edit_names,
    ends_blocks, rewrites (block, insert, delete), soft_input."""

    commit: Array
    remask: Array | None = None
    edit: Array | None = None
    finished: Array | None = None
    block: Array | None = None
    insert: Array | None = None
    delete: Array | None = None
    soft_weight: Array | None = None


class RuleBase:
    """Mixin for rule dataclasses: `name`, `clause_names`, `spec()`, `validate()`, stateless `init`, and the
    loop's bound on passes."""

    name: ClassVar[str]
    clause_names: ClassVar[tuple[str, ...]] = ("commit",)
    remask_names: ClassVar[tuple[str, ...]] = ()
    region: ClassVar[str] = "block"
    probes: ClassVar[bool] = False
    resets_state: ClassVar[bool] = True
    edit_names: ClassVar[tuple[str, ...]] = ()
    ends_blocks: ClassVar[bool] = False
    canvas: ClassVar[bool] = False
    rewrites: ClassVar[bool] = False
    soft_input: ClassVar[bool] = False

    def __post_init__(self):
        # Settings are checked when a rule is made (LocalLeap(kappa="high") is one line here, not an error inside
        # generate); what depends on the canvas, or on other settings, waits for `validate`.
        check_settings(self, made=True)

    def pass_bound(self, gen_length: int, block_length: int) -> int:
        """The passes a row may need at most (DecodeConfig.max_passes's default): a rule that only commits
        commits at least one token per pass, so gen_length passes always suffice."""
        return gen_length

    def min_passes(self, gen_length: int, block_length: int) -> int:
        """The passes a row needs at least (a max_passes below it is refused up front): one per block, or the
        schedule's steps."""
        steps = getattr(self, "steps", None)
        if steps is not None and not isinstance(steps, jax.core.Tracer):
            return int(np.max(np.asarray(steps)))
        return max(gen_length // block_length, 1)

    def init(self, batch: int, block: int, vocab: int) -> State:
        return ()

    def validate(self, gen_length: int | None = None, block_length: int | None = None):
        """Raise DecodeError for a setting this rule cannot run with (before anything compiles); a rule
        on LLaDA's schedule (a `steps` setting) is also checked against the canvas."""
        check_settings(self)
        if getattr(self, "steps", None) is not None:
            check_steps(self, self.steps, gen_length, block_length)
        return self

    def with_rows(self, batch: int):
        """This rule with every setting an array of shape [batch]: what the compiled loop receives."""
        return dataclasses.replace(self, **settings_as_rows(self, batch))

    def spec(self) -> str:
        """'name:setting=value,...' with every setting, sorted: parses back with `rule(...)`."""
        return make_spec(self.name, settings_of(self))


class Rule(Protocol):
    """Everything the loop and the command lines use of a rule (`RuleBase` gives all but `update`)."""

    name: str
    clause_names: tuple[str, ...]  # what commit code k names (clause_names[k - 1])
    region: str  # "block" | "generated"
    probes: bool
    remask_names: tuple[str, ...]
    resets_state: bool
    edit_names: tuple[str, ...]
    ends_blocks: bool
    canvas: bool  # a canvas rule (rules.canvas): it also has temperature(step)
    rewrites: bool  # it returns the region it writes (Decision.block)
    soft_input: bool  # it weighs the next pass's input embedding (Decision.soft_weight)

    def init(self, batch: int, block: int, vocab: int) -> State: ...

    def update(self, signals: Signals, state: State) -> tuple[Array | Decision, State]: ...

    def validate(self, gen_length: int | None = None, block_length: int | None = None) -> "Rule": ...

    def with_rows(self, batch: int) -> "Rule": ...

    def pass_bound(self, gen_length: int, block_length: int) -> int: ...

    def min_passes(self, gen_length: int, block_length: int) -> int: ...

    def spec(self) -> str: ...
