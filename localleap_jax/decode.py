"""The whole generation as one jitted `lax.while_loop`.

Canvas layout per row: [left-padded prompt (Lp) | gen_length mask tokens]. The generated
region is split into blocks of `block_length`, decoded left to right. Each loop iteration is
one forward pass for the batch:

  1. hidden states of the canvas (or, with a KV cache, of a window of it),
  2. LM head, confidence and prediction on each row's current block only ([B, T, V] logits,
     never [B, L, V]),
  3. the strategy's commit rule picks positions, which take their predictions,
  4. per row: a full block moves the row to its next block (or ends it: last block, or early
     stop on EOS); NFE counts the rows that were still working.

Everything is static-shaped; per-row state lives in arrays, so the loop has no host round trip.
`generate` validates the configuration before anything compiles and keeps one compiled
program per (batch, bucketed prompt length, config).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from localleap_jax import strategies
from localleap_jax.config import ModelConfig
from localleap_jax.model import CacheWrite, KVCache, head, positions_from_mask, trunk, trunk_cached

CACHE_MODES = ("none", "prefix", "dual")


class DecodeError(ValueError):
    """A decoding configuration or input that cannot run."""


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    strategy: str = "localleap"
    gen_length: int = 256
    block_length: int = 32
    kappa: float = 0.9  # anchor threshold (and the plain threshold of `threshold`)
    radius: int = 4  # W: positions an anchor relaxes on each side
    tau: float = 0.75  # relaxed threshold near an anchor
    steps: int | None = None  # low_confidence only: total steps; None = gen_length (1 token per step)
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
    def total_steps(self) -> int:
        return self.gen_length if self.steps is None else self.steps

    def validate(self) -> "DecodeConfig":
        def bad(msg):
            raise DecodeError(msg)
        if self.strategy not in strategies.STRATEGIES:
            bad(f"unknown strategy {self.strategy!r}; choose from {', '.join(sorted(strategies.STRATEGIES))}")
        if self.cache not in CACHE_MODES:
            bad(f"unknown cache {self.cache!r}; choose from {', '.join(CACHE_MODES)}")
        if self.gen_length <= 0 or self.block_length <= 0:
            bad(f"gen_length ({self.gen_length}) and block_length ({self.block_length}) must be positive")
        if self.gen_length % self.block_length:
            bad(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")
        if self.steps is not None:
            if self.steps <= 0 or self.steps % self.num_blocks:
                bad(f"steps={self.steps} is not a positive multiple of the number of blocks ({self.num_blocks})")
            if self.steps > self.gen_length:
                bad(f"steps={self.steps} > gen_length={self.gen_length}: some steps would commit nothing")
        for name in ("kappa", "tau"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                bad(f"{name}={v} must lie in (0, 1]")
        if self.tau > self.kappa:
            bad(f"tau={self.tau} > kappa={self.kappa}: the relaxed threshold must not be stricter")
        if self.radius < 0:
            bad(f"radius={self.radius} must be >= 0")
        if self.temperature < 0:
            bad(f"temperature={self.temperature} must be >= 0")
        if self.prompt_bucket <= 0:
            bad(f"prompt_bucket={self.prompt_bucket} must be positive")
        return self


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # [B, Lp + G] int32: prompt (as given, left-padded) then the generated canvas
    nfe: np.ndarray  # [B] forward passes during which each row was still generating
    forward_passes: int  # forward passes the batch ran (loop iterations)
    full_passes: int  # of which ran the whole canvas (all of them without a KV cache)
    prompt_length: int  # Lp: generated ids are tokens[:, prompt_length:]
    seconds: float  # wall time of the run, compilation excluded
    compile_seconds: float  # 0.0 when the program was already compiled


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    mask: int
    eos: int
    eot: int | None


class LoopState(NamedTuple):
    x: Int[Array, "B L"]  # the canvas
    block: Int[Array, "B"]  # current block per row
    step_in_block: Int[Array, "B"]  # steps taken in the current block (drives low_confidence's schedule)
    done: Bool[Array, "B"]
    nfe: Int[Array, "B"]
    passes: Int[Array, ""]
    full_passes: Int[Array, ""]
    cache: Any  # KVCache, or () without a cache


# ---------------------------------------------------------------- one step's pieces (pure)


def schedule_quota(step_in_block: Int[Array, "B"], cfg: DecodeConfig) -> Int[Array, "B"]:
    """LLaDA's get_num_transfer_tokens: block_length spread over the block's steps, remainder first."""
    steps_per_block = cfg.total_steps // cfg.num_blocks
    base, remainder = divmod(cfg.block_length, steps_per_block)
    return base + (step_in_block < remainder).astype(jnp.int32)


def predict(logits: Float[Array, "B T V"], cfg: DecodeConfig, ids: SpecialIds, key: jax.Array | None
            ) -> tuple[Int[Array, "B T"], Float[Array, "B T"]]:
    """Prediction and its confidence (softmax probability), in fp32, without keeping a softmax."""
    logits = logits.astype(jnp.float32)
    if cfg.logits_eos_inf:
        logits = logits.at[..., ids.eos].set(-jnp.inf)
    if cfg.temperature > 0:
        pred = jax.random.categorical(key, logits / cfg.temperature, axis=-1)  # Gumbel-max
    else:
        pred = jnp.argmax(logits, axis=-1)
    scored = logits
    if cfg.confidence_eos_eot_inf:
        scored = scored.at[..., ids.eos].set(-jnp.inf)
        if ids.eot is not None:
            scored = scored.at[..., ids.eot].set(-jnp.inf)
    picked = jnp.take_along_axis(scored, pred[..., None], axis=-1)[..., 0]
    conf = jnp.exp(picked - jax.nn.logsumexp(scored, axis=-1))
    return pred.astype(jnp.int32), conf


def _rows_take(a: Array, idx: Int[Array, "B T"]) -> Array:
    """a[b, idx[b, t], ...] for every row b."""
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


# ---------------------------------------------------------------- the loop


def decode_loop(params, ids: Int[Array, "B P"], mask: Bool[Array, "B P"], rng: jax.Array | None, *,
                config: ModelConfig, cfg: DecodeConfig, special: SpecialIds):
    """The whole generation for one batch: returns (canvas [B, P+G], nfe [B], passes, full passes)."""
    B, P = ids.shape
    G, T = cfg.gen_length, cfg.block_length
    L = P + G
    x0 = jnp.concatenate([ids.astype(jnp.int32), jnp.full((B, G), special.mask, jnp.int32)], axis=1)
    key_mask = jnp.concatenate([mask.astype(bool), jnp.ones((B, G), bool)], axis=1)
    positions = positions_from_mask(key_mask)
    rule = strategies.get(cfg.strategy)
    in_block = jnp.arange(T)
    # Batch policy. Without a cache each row moves to its next block as soon as its own block is full.
    # With a cache the rows advance through blocks together, so one full-canvas refresh per block serves
    # the whole batch. The cost: a row that fills its block early waits (no commits, no NFE) while the
    # batch still runs forward passes for the slowest row, so the batch makes sum over blocks of the
    # slowest row's steps passes instead of the slowest row's total. The alternative, refreshing all rows
    # whenever any row starts a block, turns most passes into full forwards once rows drift apart at
    # B > 1. bench_decode.py reports both the passes and the full passes.
    together = cfg.cache != "none"

    def block_hidden(state: LoopState, starts, idx, x_blk, need_refresh) -> tuple[Float[Array, "B T D"], Any]:
        """Hidden states at each row's block positions `idx` [B, T] (tokens `x_blk`), and the cache."""
        if cfg.cache == "none":
            h, _ = trunk(params, state.x, positions, key_mask, config)
            return _rows_take(h, idx), ()

        def refresh(_):
            # Full forward over the canvas; its K/V become the cache for the whole block.
            h, kv = trunk(params, state.x, positions, key_mask, config)
            return _rows_take(h, idx), kv

        def cached(_):
            if cfg.cache == "dual":  # queries: the block only; every other position's K/V cached
                write = CacheWrite(starts, jnp.ones((B, T), bool))
                h = trunk_cached(params, x_blk, _rows_take(positions, idx), key_mask,
                                 state.cache, write, config)
                return h, state.cache
            # prefix: the block and everything after it are recomputed; the prefix K/V are cached.
            # The window is the whole generated region (static shape); K/V of its positions
            # before the block come from the cache, so those queries are computed and discarded.
            gen_idx = P + jnp.arange(G)
            write = CacheWrite(jnp.full((B,), P, jnp.int32), gen_idx[None, :] >= starts[:, None])
            h = trunk_cached(params, state.x[:, P:], positions[:, P:], key_mask, state.cache, write, config)
            return _rows_take(h, idx - P), state.cache

        return jax.lax.cond(need_refresh, refresh, cached, None)

    def body(state: LoopState) -> LoopState:
        starts = P + state.block * T  # [B] first canvas position of each row's block
        idx = starts[:, None] + in_block  # [B, T]
        # A cache is refreshed when the (shared) block starts: Fast-dLLM's full forward per block.
        need_refresh = jnp.any(~state.done & (state.step_in_block == 0))
        x_blk = _rows_take(state.x, idx)
        h, cache = block_hidden(state, starts, idx, x_blk, need_refresh)
        logits = head(params, h, config)  # [B, T, V]
        key = None if rng is None else jax.random.fold_in(rng, state.passes)
        pred, conf = predict(logits, cfg, special, key)
        candidates = (x_blk == special.mask) & ~state.done[:, None]
        working = jnp.any(candidates, axis=1)
        p = strategies.RuleParams(cfg.kappa, cfg.tau, cfg.radius, schedule_quota(state.step_in_block, cfg))
        # Enforce the rule contract here: commits are candidates, and at least one per working row.
        commit = candidates & (rule(conf, candidates, p) | strategies.most_confident(conf, candidates))
        x_blk = jnp.where(commit, pred, x_blk)
        x = state.x.at[jnp.arange(B)[:, None], idx].set(x_blk)

        block_full = ~jnp.any(x_blk == special.mask, axis=1)
        last_block = state.block == cfg.num_blocks - 1
        stop_here = jnp.zeros_like(block_full)
        if cfg.early_stop:
            stop_here = block_full & jnp.any(x_blk == special.eos, axis=1) & ~last_block
            after = jnp.arange(L)[None, :] >= (starts + T)[:, None]
            x = jnp.where(stop_here[:, None] & after, special.eos, x)
        finished = ~state.done & block_full & (last_block | stop_here)
        done = state.done | finished
        if together:  # advance only when every unfinished row has filled the shared block
            advance = jnp.all(done | block_full) & ~done
            advance = jnp.broadcast_to(advance, block_full.shape)
            moved = jnp.all(done | block_full)
        else:
            advance = block_full & ~done
            moved = block_full
        return LoopState(
            x=x,
            block=jnp.where(advance, state.block + 1, state.block),
            step_in_block=jnp.where(moved | done, 0, state.step_in_block + working.astype(jnp.int32)),
            done=done,
            nfe=state.nfe + working.astype(jnp.int32),
            passes=state.passes + 1,
            full_passes=state.full_passes + (1 if cfg.cache == "none" else need_refresh.astype(jnp.int32)),
            cache=cache,
        )

    def cond(state: LoopState):
        # Every working row commits at least one token per pass, so G passes always suffice.
        return ~jnp.all(state.done) & (state.passes < G)

    zeros = jnp.zeros((B,), jnp.int32)
    cache0 = ()
    if cfg.cache != "none":
        dtype = params["wte"]["embedding"].dtype
        shape = (config.n_layers, B, L, config.n_kv_heads, config.head_dim)
        cache0 = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    state = LoopState(x0, zeros, zeros, jnp.zeros((B,), bool), zeros, jnp.int32(0), jnp.int32(0), cache0)
    state = jax.lax.while_loop(cond, body, state)
    return state.x, state.nfe, state.passes, state.full_passes


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


def compile_once(params, arrays, settings: tuple, lower) -> tuple[Any, float]:
    """The compiled program for these parameters, input shapes and static settings, compiling it with
    `lower()` only on first use; returns (executable, seconds spent compiling, 0.0 if it was cached)."""
    spec = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    leaves, treedef = jax.tree.flatten(params)
    key = (settings, treedef, tuple(map(spec, leaves)), tuple(map(spec, arrays)))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    _COMPILED[key] = lower().compile()
    return _COMPILED[key], time.perf_counter() - t0


def special_ids(model) -> SpecialIds:
    return SpecialIds(model.config.mask_token_id, model.config.eos_token_id,
                      None if model.tokenizer is None else model.tokenizer.eot_id)


def generate(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), rng: jax.Array | None = None) -> Generation:
    """Decode a batch of left-padded prompts (ids [B, Lp], mask [B, Lp]) with one compiled loop."""
    ids_b, mask_b, pad = prepare_inputs(ids, mask, cfg, model.config, rng)
    special = special_ids(model)
    sampling_rng = rng if cfg.temperature > 0 else None
    loop = jax.jit(decode_loop, static_argnames=("config", "cfg", "special"))
    compiled, compile_s = compile_once(
        model.params, (ids_b, mask_b, sampling_rng), ("single", model.config, cfg, special),
        lambda: loop.lower(model.params, ids_b, mask_b, sampling_rng, config=model.config, cfg=cfg, special=special))
    t0 = time.perf_counter()
    x, nfe, passes, full = compiled(model.params, ids_b, mask_b, sampling_rng)
    x = np.asarray(x)  # waits for the device
    seconds = time.perf_counter() - t0
    return Generation(tokens=x[:, pad:], nfe=np.asarray(nfe), forward_passes=int(passes), full_passes=int(full),
                      prompt_length=ids_b.shape[1] - pad, seconds=seconds, compile_seconds=compile_s)
