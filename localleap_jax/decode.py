"""The whole generation as one jitted `lax.while_loop`.

Canvas layout per row: [left-padded prompt (Lp) | gen_length mask tokens]. The generated
region is split into blocks of `block_length`, decoded left to right. Each loop iteration is
one forward pass for the batch:

  1. hidden states of the canvas (or, with a KV cache, of a window of it),
  2. LM head, confidence and prediction on each row's current block only ([B, T, V] logits,
     never [B, L, V]),
  3. the rule (`localleap_jax.rules`) picks positions from the step's signals, which take their
     predictions; the rule's own state rides along in the loop,
  4. per row: a full block moves the row to its next block (or ends it: last block, or early
     stop on EOS) and resets its rule state; NFE counts the rows that were still working.

Everything is static-shaped; per-row state lives in arrays, so the loop has no host round trip.
The rule's settings are arrays of one value per row, inputs of the program rather than constants,
so a sweep over them runs one compiled program. `generate` validates the configuration before
anything compiles and keeps one compiled program per (batch, bucketed prompt length, loop
settings, rule structure).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from localleap_jax import rules
from localleap_jax.config import ModelConfig
from localleap_jax.denoiser import Denoiser, ModelDenoiser
from localleap_jax.model import CacheWrite, positions_from_mask
from localleap_jax.rules import DecodeError, Signals, most_confident
from localleap_jax.rules.base import check_settings
from localleap_jax.trace import Trace

CACHE_MODES = ("none", "prefix", "dual")
_LEGACY_SETTINGS = ("kappa", "tau", "radius", "steps")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    strategy: Any = "localleap"  # a rule object (ll.rule(...)), or a name / spec string such as "eb:gamma=0.01"
    gen_length: int = 256
    block_length: int = 32
    # Deprecated: settings of a strategy given by name (None: the rule's default). Prefer
    # ll.rule("localleap", kappa=..., tau=..., radius=...). A rule that has no such setting ignores it.
    kappa: float | None = None
    radius: int | None = None
    tau: float | None = None
    steps: int | None = None
    temperature: float = 0.0  # 0: argmax; > 0: Gumbel-max sampling (needs rng)
    early_stop: bool = False  # a finished block holding EOS fills the rest with EOS and ends the row
    logits_eos_inf: bool = False  # LLaDA switch: never predict EOS
    confidence_eos_eot_inf: bool = False  # LLaDA switch: EOS/EOT predictions get confidence 0 (commit last)
    cache: str = "none"  # "none" | "prefix" | "dual" (Fast-dLLM KV caches)
    prompt_bucket: int = 64  # prompts are left-padded to a multiple of this, to bound recompiles

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def rule(self):
        """The rule object this config decodes with (a name plus the deprecated fields, mapped)."""
        legacy = {k: getattr(self, k) for k in _LEGACY_SETTINGS if getattr(self, k) is not None}
        if not isinstance(self.strategy, str):
            if legacy:
                raise DecodeError(f"{', '.join(legacy)} given beside a rule object: set them on the rule, e.g. "
                                  f"ll.rule({self.strategy.name!r}, {', '.join(f'{k}=...' for k in legacy)})")
            return self.strategy
        name, given = rules.parse_spec(self.strategy)
        if name not in rules.RULES:
            raise DecodeError(f"unknown strategy {name!r}; choose from {', '.join(sorted(rules.RULES))}")
        takes = _settings_taken(rules.RULES[name])
        mapped = {k: v for k, v in legacy.items() if k in takes and k not in given}
        return rules.rule(self.strategy, **mapped)

    def validate(self) -> "DecodeConfig":
        def bad(msg):
            raise DecodeError(msg)
        for name in ("gen_length", "block_length", "prompt_bucket"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                bad(f"{name}={v!r} must be a whole number")
        for name in ("temperature",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(v):
                bad(f"{name}={v!r} must be a finite number")
        for name in ("early_stop", "logits_eos_inf", "confidence_eos_eot_inf"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                bad(f"{name}={getattr(self, name)!r} must be True or False")
        if self.cache not in CACHE_MODES:
            bad(f"unknown cache {self.cache!r}; choose from {', '.join(CACHE_MODES)}")
        if self.gen_length <= 0 or self.block_length <= 0:
            bad(f"gen_length ({self.gen_length}) and block_length ({self.block_length}) must be positive")
        if self.gen_length % self.block_length:
            bad(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")
        if self.temperature < 0:
            bad(f"temperature={self.temperature} must be >= 0")
        if self.prompt_bucket <= 0:
            bad(f"prompt_bucket={self.prompt_bucket} must be positive")
        # The deprecated fields keep their range checks even where the named rule ignores them.
        legacy = {k: getattr(self, k) for k in ("kappa", "tau", "radius") if getattr(self, k) is not None}
        check_settings(rules.LocalLeap(**legacy))
        if self.kappa is not None and self.tau is not None and self.tau > self.kappa:
            bad(f"tau={self.tau} > kappa={self.kappa}: the relaxed threshold must not be stricter than the anchor")
        rules.LowConfidence(self.steps).validate(self.gen_length, self.block_length)
        self.rule.validate(self.gen_length, self.block_length)
        return self

    def loop_settings(self, trace: bool = False) -> "LoopSettings":
        return LoopSettings(self.gen_length, self.block_length, float(self.temperature), bool(self.early_stop),
                            bool(self.logits_eos_inf), bool(self.confidence_eos_eot_inf), self.cache, bool(trace))

    def fingerprint(self) -> dict[str, Any]:
        """Everything in this config that changes the generated tokens, JSON-able (for resume keys)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("strategy", "prompt_bucket", *_LEGACY_SETTINGS)}
        return {**out, "rule": self.rule.spec()}


def _settings_taken(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if "setting" in f.metadata}
    return set(_LEGACY_SETTINGS)  # a legacy function rule: it reads kappa, tau, radius and steps


class LoopSettings(NamedTuple):
    """The compile-time part of a DecodeConfig (the rule's settings are runtime inputs)."""

    gen_length: int
    block_length: int
    temperature: float
    early_stop: bool
    logits_eos_inf: bool
    confidence_eos_eot_inf: bool
    cache: str
    trace: bool


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # [B, Lp + G] int32: prompt (as given, left-padded) then the generated canvas
    nfe: np.ndarray  # [B] forward passes during which each row was still generating
    forward_passes: int  # forward passes the batch ran (loop iterations)
    full_passes: int  # of which ran the whole canvas (all of them without a KV cache)
    prompt_length: int  # Lp: generated ids are tokens[:, prompt_length:]
    seconds: float  # wall time of the run, compilation excluded
    compile_seconds: float  # 0.0 when the program was already compiled
    trace: Trace | None = None  # with generate(..., trace=True)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    mask: int
    eos: int
    eot: int | None
    vocab_limit: int | None = None  # ids >= this are never predicted (the tokenizer cannot decode them)


class TraceBuffers(NamedTuple):
    """Per-pass records inside the loop (see trace.py); absent from the loop state when not tracing."""

    pred: Int[Array, "B S G"]
    conf: Float[Array, "B S G"]
    clause: Int[Array, "B S G"]
    commit_pass: Int[Array, "B G"]


class LoopState(NamedTuple):
    x: Int[Array, "B L"]  # the canvas
    block: Int[Array, "B"]  # current block per row
    step_in_block: Int[Array, "B"]  # steps taken in the current block (drives LLaDA's schedule)
    done: Bool[Array, "B"]
    nfe: Int[Array, "B"]
    passes: Int[Array, ""]
    full_passes: Int[Array, ""]
    cache: Any  # KVCache, or () without a cache
    rule_state: Any  # the rule's own state, leading axis B
    trace: Any  # TraceBuffers, or () when not tracing


# ---------------------------------------------------------------- one step's pieces (pure)


def predict(logits: Float[Array, "B T V"], loop: LoopSettings, ids: SpecialIds, key: jax.Array | None
            ) -> tuple[Int[Array, "B T"], Float[Array, "B T"], Float[Array, "B T V"]]:
    """Prediction, its confidence (softmax probability) and the scored logits, all fp32.

    The scored logits are the distribution every confidence-like signal comes from: LLaDA's
    switches put EOS (and EOT) at -inf there. The mask token and ids the tokenizer cannot decode are
    never predicted, but keep their (tiny, in a trained model) share of the softmax, as in the
    published code, which would write them into the canvas."""
    logits = logits.astype(jnp.float32)
    if loop.logits_eos_inf:
        logits = logits.at[..., ids.eos].set(-jnp.inf)
    # Never predict the mask token (a committed mask would stay a hole) or an id the tokenizer cannot decode.
    vocab = jnp.arange(logits.shape[-1])
    allowed = vocab != ids.mask
    if ids.vocab_limit is not None and ids.vocab_limit < logits.shape[-1]:
        allowed &= vocab < ids.vocab_limit
    choosable = jnp.where(allowed, logits, -jnp.inf)
    if loop.temperature > 0 and key is not None:
        pred = jax.random.categorical(key, choosable / loop.temperature, axis=-1)  # Gumbel-max
    else:
        pred = jnp.argmax(choosable, axis=-1)
    scored = logits
    if loop.confidence_eos_eot_inf:
        scored = scored.at[..., ids.eos].set(-jnp.inf)
        if ids.eot is not None:
            scored = scored.at[..., ids.eot].set(-jnp.inf)
    picked = jnp.take_along_axis(scored, pred[..., None], axis=-1)[..., 0]
    # A prediction the switch put at -inf (EOS/EOT, or a row with nothing else finite) has confidence 0, not the
    # NaN that exp(-inf - -inf) gives: a NaN would rank first in every argmax and commit first instead of last.
    conf = jnp.where(jnp.isneginf(picked), 0.0, jnp.exp(picked - jax.nn.logsumexp(scored, axis=-1)))
    return pred.astype(jnp.int32), conf, scored


def _rows_take(a: Array, idx: Int[Array, "B T"]) -> Array:
    """a[b, idx[b, t], ...] for every row b."""
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


def _rows_where(rows: Bool[Array, "B"], new, old):
    """Per row of every leaf: `new` where rows[b], else `old`."""
    return jax.tree.map(lambda n, o: jnp.where(rows.reshape(rows.shape + (1,) * (n.ndim - 1)), n, o), new, old)


# ---------------------------------------------------------------- the loop


class LoopOutput(NamedTuple):
    x: Int[Array, "B L"]
    nfe: Int[Array, "B"]
    passes: Int[Array, ""]
    full_passes: Int[Array, ""]
    trace: Any  # TraceBuffers, or ()


def decode_loop(denoiser: Denoiser, ids: Int[Array, "B P"], mask: Bool[Array, "B P"], rng: jax.Array | None, rule,
                *, loop: LoopSettings, special: SpecialIds) -> LoopOutput:
    """The whole generation for one batch. `rule` has one value per row in every setting (`with_rows`)."""
    B, P = ids.shape
    G, T = loop.gen_length, loop.block_length
    L = P + G
    num_blocks = G // T
    shift = denoiser.shift  # Dream predicts position i from the hidden state at i - 1
    x0 = jnp.concatenate([ids.astype(jnp.int32), jnp.full((B, G), special.mask, jnp.int32)], axis=1)
    key_mask = jnp.concatenate([mask.astype(bool), jnp.ones((B, G), bool)], axis=1)
    positions = positions_from_mask(key_mask)
    in_block = jnp.arange(T)
    rows = jnp.arange(B)[:, None]
    rule_state0 = rule.init(B, T, denoiser.vocab)
    forced_top1 = len(rule.clause_names) + 1  # the clause code of a commit only the loop's contract made
    # Batch policy. Without a cache each row moves to its next block as soon as its own block is full.
    # With a cache the rows advance through blocks together, so one full-canvas refresh per block serves
    # the whole batch. The cost: a row that fills its block early waits (no commits, no NFE) while the
    # batch still runs forward passes for the slowest row, so the batch makes sum over blocks of the
    # slowest row's steps passes instead of the slowest row's total. The alternative, refreshing all rows
    # whenever any row starts a block, turns most passes into full forwards once rows drift apart at
    # B > 1. bench_decode.py reports both the passes and the full passes.
    together = loop.cache != "none"

    def from_canvas(h_all, idx):
        """From a full-canvas pass: the hidden states that predict the block, and (tracing) the region."""
        h_blk = _rows_take(h_all, idx - shift if shift else idx)
        h_region = h_all[:, P - shift:L - shift] if loop.trace else None
        return h_blk, h_region

    def hidden(state: LoopState, starts, idx, x_blk, need_refresh):
        """(hidden states predicting each row's block [B, T, D], those predicting the generated region
        [B, G, D] when tracing and the pass computes them (else None), the cache)."""
        if loop.cache == "none":
            h_all, _ = denoiser.full(state.x, positions, key_mask)
            return (*from_canvas(h_all, idx), ())

        def refresh(_):
            # Full forward over the canvas; its K/V become the cache for the whole block.
            h_all, kv = denoiser.full(state.x, positions, key_mask)
            h_blk, h_region = from_canvas(h_all, idx)
            return h_blk, h_region if loop.cache == "prefix" else None, kv

        def cached(_):
            if loop.cache == "dual":
                # Queries: the block, and with a shift the position before it, whose hidden state predicts
                # the block's first token (its own K/V stay the cache's); every other K/V is cached.
                win = (starts - shift)[:, None] + jnp.arange(T + shift)
                fresh = jnp.broadcast_to(jnp.arange(T + shift) >= shift, (B, T + shift))
                tokens = x_blk if not shift else _rows_take(state.x, win)
                h = denoiser.window(tokens, _rows_take(positions, win), key_mask, state.cache,
                                    CacheWrite(starts - shift, fresh))
                return h[:, :T], None, state.cache
            # prefix: the block and everything after it are recomputed; the prefix K/V are cached.
            # The window is the whole generated region (static shape, plus the position before it with a
            # shift); K/V of its positions before the block come from the cache, so those queries are
            # computed and discarded (or, tracing, recorded).
            w0 = P - shift
            write = CacheWrite(jnp.full((B,), w0, jnp.int32), (w0 + jnp.arange(G + shift))[None, :] >= starts[:, None])
            h = denoiser.window(state.x[:, w0:], positions[:, w0:], key_mask, state.cache, write)
            return _rows_take(h, idx - P), h[:, :G] if loop.trace else None, state.cache

        return jax.lax.cond(need_refresh, refresh, cached, None)

    def record(buffers: TraceBuffers, state: LoopState, h_region, idx, pred, conf, code, working):
        """Write this pass into each working row's slot (the row's pass number = its NFE so far)."""
        if h_region is not None:
            region_pred, region_conf, _ = predict(denoiser.head(h_region), loop._replace(temperature=0.0),
                                                  special, None)
        else:  # the pass computed only the block
            region_pred = jnp.full((B, G), -1, jnp.int32)
            region_conf = jnp.full((B, G), jnp.nan, jnp.float32)
        at = idx - P
        # Inside the block, record exactly what the rule saw (sampled predictions included).
        region_pred = region_pred.at[rows, at].set(pred)
        region_conf = region_conf.at[rows, at].set(conf)
        region_code = jnp.zeros((B, G), jnp.int8).at[rows, at].set(code)
        s = jnp.minimum(state.nfe, G - 1)
        keep = lambda buf, new: buf.at[rows[:, 0], s].set(jnp.where(working[:, None], new, buf[rows[:, 0], s]))  # noqa: E731
        commit_pass = jnp.where(region_code > 0, state.nfe[:, None], buffers.commit_pass)
        return TraceBuffers(keep(buffers.pred, region_pred), keep(buffers.conf, region_conf),
                            keep(buffers.clause, region_code), commit_pass)

    def body(state: LoopState) -> LoopState:
        starts = P + state.block * T  # [B] first canvas position of each row's block
        idx = starts[:, None] + in_block  # [B, T]
        # A cache is refreshed when the (shared) block starts: Fast-dLLM's full forward per block.
        need_refresh = jnp.any(~state.done & (state.step_in_block == 0))
        x_blk = _rows_take(state.x, idx)
        h_blk, h_region, cache = hidden(state, starts, idx, x_blk, need_refresh)
        logits = denoiser.head(h_blk)  # [B, T, V]
        key = None if rng is None else jax.random.fold_in(rng, state.passes)
        pred, conf, scored = predict(logits, loop, special, key)
        candidates = (x_blk == special.mask) & ~state.done[:, None]
        working = jnp.any(candidates, axis=1)
        signals = Signals(logits=scored, pred=pred, conf=conf, candidates=candidates, step=state.step_in_block,
                          gen_length=G, block_length=T)
        code, rule_state = rule.update(signals, state.rule_state)
        # Enforce the rule contract here: commits are candidates, and at least one per working row (a row
        # where the rule chose nothing commits its most confident candidate).
        code = jnp.where(candidates, code.astype(jnp.int8), jnp.int8(0))
        chose_none = ~jnp.any(code > 0, axis=1, keepdims=True)
        code = jnp.where(chose_none & most_confident(conf, candidates), jnp.int8(forced_top1), code)
        commit = code > 0
        x_blk = jnp.where(commit, pred, x_blk)
        x = state.x.at[rows, idx].set(x_blk)

        block_full = ~jnp.any(x_blk == special.mask, axis=1)
        last_block = state.block == num_blocks - 1
        stop_here = jnp.zeros_like(block_full)
        if loop.early_stop:
            stop_here = block_full & jnp.any(x_blk == special.eos, axis=1) & ~last_block
            after = jnp.arange(L)[None, :] >= (starts + T)[:, None]
            x = jnp.where(stop_here[:, None] & after, special.eos, x)
        finished = ~state.done & block_full & (last_block | stop_here)
        done = state.done | finished
        if together:  # advance only when every unfinished row has filled the shared block
            moved = jnp.all(done | block_full)
            advance = jnp.broadcast_to(moved & ~done, block_full.shape)
        else:
            advance = block_full & ~done
            moved = block_full
        # A row entering a new block starts afresh. (A row with no candidates is done, or waits with a full
        # block for the batch to advance, which resets it: what its update did meanwhile is never read.)
        rule_state = _rows_where(advance, rule_state0, rule_state)
        trace = record(state.trace, state, h_region, idx, pred, conf, code, working) if loop.trace else ()
        return LoopState(
            x=x,
            block=jnp.where(advance, state.block + 1, state.block),
            step_in_block=jnp.where(moved | done, 0, state.step_in_block + working.astype(jnp.int32)),
            done=done,
            nfe=state.nfe + working.astype(jnp.int32),
            passes=state.passes + 1,
            full_passes=state.full_passes + (1 if loop.cache == "none" else need_refresh.astype(jnp.int32)),
            cache=cache,
            rule_state=rule_state,
            trace=trace,
        )

    def cond(state: LoopState):
        # Every working row commits at least one token per pass, so G passes always suffice.
        return ~jnp.all(state.done) & (state.passes < G)

    zeros = jnp.zeros((B,), jnp.int32)
    cache0 = () if loop.cache == "none" else denoiser.empty_cache(B, L)
    trace0 = ()
    if loop.trace:
        trace0 = TraceBuffers(jnp.full((B, G, G), -1, jnp.int32), jnp.full((B, G, G), jnp.nan, jnp.float32),
                              jnp.zeros((B, G, G), jnp.int8), jnp.full((B, G), -1, jnp.int32))
    state = LoopState(x0, zeros, zeros, jnp.zeros((B,), bool), zeros, jnp.int32(0), jnp.int32(0), cache0,
                      rule_state0, trace0)
    state = jax.lax.while_loop(cond, body, state)
    return LoopOutput(state.x, state.nfe, state.passes, state.full_passes, state.trace)


# ---------------------------------------------------------------- the public entry point


def prepare_inputs(ids, mask, cfg: DecodeConfig, config: ModelConfig, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate user inputs and left-pad prompts to the bucket; returns (ids, mask, pad added)."""
    cfg.validate()
    ids = np.asarray(ids)
    mask = np.ones(ids.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise DecodeError(f"ids must be [batch, prompt_length] with a mask of the same shape; got ids "
                          f"{ids.shape}, mask {mask.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise DecodeError(f"ids must be integer token ids, got dtype {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise DecodeError(f"empty batch or empty prompts (ids shape {ids.shape})")
    if cfg.gen_length >= config.max_sequence_length:
        raise DecodeError(f"gen_length={cfg.gen_length} leaves no room for a prompt: the model's "
                          f"max_sequence_length is {config.max_sequence_length}")
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise DecodeError(f"rows {empty.tolist()} have an empty prompt (mask all False)")
    if ((ids < 0) | (ids >= config.embedding_size))[mask].any():
        raise DecodeError(f"token ids must lie in [0, {config.embedding_size})")
    longest = int(mask.sum(axis=1).max())
    if longest + cfg.gen_length > config.max_sequence_length:
        raise DecodeError(f"prompt ({longest} tokens) + gen_length ({cfg.gen_length}) exceeds the model's "
                          f"max_sequence_length ({config.max_sequence_length})")
    if cfg.temperature > 0 and rng is None:
        raise DecodeError(f"temperature={cfg.temperature} samples: pass rng=jax.random.key(seed)")
    P = ids.shape[1]
    bucket = -(-P // cfg.prompt_bucket) * cfg.prompt_bucket
    bucket = min(bucket, config.max_sequence_length - cfg.gen_length)  # never pad past the model's limit
    pad = max(bucket - P, 0)
    ids = np.pad(ids, ((0, 0), (pad, 0)), constant_values=config.pad_token_id).astype(np.int32)
    mask = np.pad(mask, ((0, 0), (pad, 0)))
    return ids, mask, pad


_COMPILED: dict = {}  # program key -> compiled executable, shared by generate and parallel.generate_parallel


def compile_once(denoiser, inputs, settings: tuple, lower) -> tuple[Any, float]:
    """The compiled program for this denoiser and these inputs (pytrees: their structure, static fields
    and leaf shapes and dtypes) and static settings, compiling it with `lower()` only on first use; returns (executable,
    seconds spent compiling, 0.0 if it was cached)."""
    def signature(tree):
        leaves, treedef = jax.tree.flatten(tree)
        return treedef, tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in leaves)
    key = (settings, signature(denoiser), signature(inputs))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    _COMPILED[key] = lower().compile()
    return _COMPILED[key], time.perf_counter() - t0


def denoiser_of(model) -> Denoiser:
    """What the loop runs: the model's own denoiser, else its parameters and config."""
    return getattr(model, "denoiser", None) or ModelDenoiser(model.params, model.config)


def special_ids(model) -> SpecialIds:
    tok = model.tokenizer
    limit = None if tok is None else getattr(tok, "vocab_size", None) or len(tok.hf)
    return SpecialIds(model.config.mask_token_id, model.config.eos_token_id, None if tok is None else tok.eot_id,
                      limit)


def trace_of(buffers: TraceBuffers, x: np.ndarray, nfe: np.ndarray, P: int, clause_names) -> Trace:
    """The loop's trace buffers as a host-side `Trace` (P: the padded prompt length)."""
    clause = np.asarray(buffers.clause)
    return Trace(pred=np.asarray(buffers.pred), conf=np.asarray(buffers.conf), committed=clause > 0, clause=clause,
                 clause_names=tuple(clause_names) + ("top1",),  # the last: a commit only the loop's contract made
                 token=np.asarray(x)[:, P:],
                 commit_pass=np.asarray(buffers.commit_pass), passes=np.asarray(nfe))


def generate(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), rng: jax.Array | None = None, *,
             trace: bool = False, mesh=None) -> Generation:
    """Decode a batch of left-padded prompts (ids [B, Lp], mask [B, Lp]) with one compiled loop.

    `trace=True` also returns `out.trace` (see localleap_jax.trace): per row and pass, the prediction
    and confidence at every generated position and what committed by which clause. It costs, per row,
    S x G x (4 + 4 + 1) bytes plus the LM head over the generated region at every pass: at LLaDA-8B's
    gen_length 256, 0.6 MB per row, and 256 x 126464 fp32 logits (129 MB) per row and pass in flight.
    With tracing off the program carries none of it. `mesh` (a jax.sharding.Mesh with "data" and
    "model" axes) runs the sharded path (localleap_jax.sharding)."""
    if mesh is not None:
        from localleap_jax.sharding import generate_sharded
        return generate_sharded(model, ids, mask, cfg, mesh, rng=rng, trace=trace)
    ids_b, mask_b, pad = prepare_inputs(ids, mask, cfg, model.config, rng)
    rule = cfg.rule.with_rows(ids_b.shape[0])
    special = special_ids(model)
    loop_settings = cfg.loop_settings(trace)
    sampling_rng = rng if cfg.temperature > 0 else None
    denoiser = denoiser_of(model)
    run = jax.jit(decode_loop, static_argnames=("loop", "special"))
    inputs = (ids_b, mask_b, sampling_rng, rule)
    compiled, compile_s = compile_once(
        denoiser, inputs, ("single", loop_settings, special),
        lambda: run.lower(denoiser, *inputs, loop=loop_settings, special=special))
    t0 = time.perf_counter()
    out = compiled(denoiser, *inputs)
    x = np.asarray(out.x)  # waits for the device
    seconds = time.perf_counter() - t0
    nfe = np.asarray(out.nfe)
    P = ids_b.shape[1]
    return Generation(tokens=x[:, pad:], nfe=nfe, forward_passes=int(out.passes), full_passes=int(out.full_passes),
                      prompt_length=P - pad, seconds=seconds, compile_seconds=compile_s,
                      trace=trace_of(out.trace, x, nfe, P, rule.clause_names) if trace else None)
