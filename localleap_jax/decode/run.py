"""Running the loop on a batch: inputs checked and bucketed, the program compiled once, the output brought home.

    out = generate(model, ids, mask, cfg, rng, trace=False)                 # one device
    out = run(model, ids, mask, cfg, rng, placement=..., trace=False)         # wherever a Placement puts it

`model` is anything with `config` (ModelConfig), `denoiser` (what the loop runs) and `special` (SpecialIds):
a loaded `ll.Model`, or a stub. A `Placement` says where the program runs and how the batch is laid out
there: `OneDevice` here; the pmap and mesh placements are in `localleap_jax.dist` (the core never imports
them: the front door, `ll.generate`, chooses one). Every placement runs the same `decode_loop` and gives the
same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Hashable, NamedTuple, Protocol

import jax
import numpy as np

from localleap_jax.compile_cache import compile_once, signature
from localleap_jax.config import ModelConfig
from localleap_jax.decode.canvas import grid_tail
from localleap_jax.decode.config import DecodeConfig, check_room, grid_blocks, prompt_arrays
from localleap_jax.decode import progress
from localleap_jax.decode.draws import prompt_draws
from localleap_jax.decode.loop import LoopOutput, PerRow, decode_loop
from localleap_jax.decode.slots import decode_slots
from localleap_jax.rules import DecodeError
from localleap_jax.rules.base import check_grid_steps
from localleap_jax.trace import Trace


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # [B, Lp + G] int32: prompt (as given, left-padded) then the generated canvas
    nfe: np.ndarray  # [B] forward passes during which each row was still generating
    forward_passes: int  # forward passes the batch ran (loop iterations; the longest data shard's)
    full_passes: int  # of which ran the whole canvas (all of them without a KV cache)
    prompt_length: int  # Lp: generated ids are tokens[:, prompt_length:]
    seconds: float  # wall time of the run, compilation excluded
    compile_seconds: float  # 0.0 when the program was already compiled
    trace: Trace | None = None  # with generate(..., trace=True)
    hit_bound: np.ndarray | None = None  # [B] bool: rows stopped by max_passes with masks left (a rule that revokes)
    remasks: np.ndarray | None = None  # [B] tokens each row took back (a rule that revokes; None for one that does not)
    edits: np.ndarray | None = None  # [B] int: tokens each row replaced by another (zeros: a rule that never edits)
    slots: int | None = None  # rows the loop held at once (all the batch's, unless generate(..., slots=S))
    inserts: np.ndarray | None = None  # [B] int: positions each row inserted (LLaDA2.2's SPLIT; zeros for other rules)
    deletes: np.ndarray | None = None  # [B] int: positions each row dropped (LLaDA2.2's DELETE; zeros for other rules)

    @property
    def occupancy(self) -> float:
        """Share of the loop's row-passes that did work: sum of NFE / (forward passes x rows held). With
        several data shards, forward passes are the longest shard's, so this is a lower bound."""
        held = self.slots or len(self.nfe)
        return float(np.sum(self.nfe)) / max(self.forward_passes * held, 1)


def check_config(cfg) -> DecodeConfig:
    """`cfg` is a DecodeConfig (a spec string or None named in one line, with what to pass)."""
    if isinstance(cfg, DecodeConfig):
        return cfg
    hint = (f"ll.DecodeConfig(strategy={cfg!r})" if isinstance(cfg, str)
            else "ll.DecodeConfig(strategy=..., gen_length=..., block_length=...), or leave it out for the defaults")
    raise DecodeError(f"cfg is {type(cfg).__name__} {cfg!r:.60}, not a DecodeConfig: pass {hint}"
                      if cfg is not None else f"cfg is None: pass {hint}")


def check_rng(rng) -> None:
    """`rng` is None or a JAX random key: jax.random.key(seed) (a typed key), or jax.random.PRNGKey(seed) (uint32 [2])."""
    if rng is None:
        return
    dtype, shape = getattr(rng, "dtype", None), getattr(rng, "shape", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
    legacy = isinstance(rng, (jax.Array, np.ndarray)) and dtype == np.uint32 and shape == (2,)
    if not (typed or legacy):
        what = f"{type(rng).__name__} {rng!r:.40}" if dtype is None else f"{type(rng).__name__} {dtype}{list(shape)}"
        raise DecodeError(f"rng is {what}, not a JAX random key: pass rng=jax.random.key(seed) (or None for greedy "
                          "decoding)")


def check_no_mask_in_prompts(ids: np.ndarray, mask: np.ndarray, config: ModelConfig) -> None:
    """A masked-diffusion model reads its mask id as a position to generate: in a prompt it would be filled in and
    the answer decoded after a corrupted prompt. (A uniform-noise canvas model has no mask: it reads every id.)"""
    if config.canvas_length:
        return
    rows = np.flatnonzero(((ids == config.mask_token_id) & mask).any(axis=1))
    if rows.size:
        shown = ", ".join(map(str, rows[:8].tolist())) + (", ..." if rows.size > 8 else "")
        raise DecodeError(f"prompt rows [{shown}] hold the mask id {config.mask_token_id}, which the model reads as a "
                          "position to generate: remove the mask token from the prompt text")


def prepare_inputs(ids, mask, cfg: DecodeConfig, config: ModelConfig, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate user inputs and left-pad prompts to the bucket; returns (ids, mask, pad added)."""
    cfg = check_config(cfg)
    check_rng(rng)
    cfg.validate(config)
    ids, mask = prompt_arrays(ids, mask)  # None, text or ragged rows: one line naming what was given
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise DecodeError(f"ids must be [batch, prompt_length] with a mask of the same shape; got ids "
                          f"{ids.shape}, mask {mask.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise DecodeError(f"ids must be integer token ids, got dtype {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise DecodeError(f"empty batch or empty prompts (ids shape {ids.shape})")
    check_room(cfg.gen_length, config.max_sequence_length)
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise DecodeError(f"rows {empty.tolist()} have an empty prompt (mask all False)")
    if ((ids < 0) | (ids >= config.embedding_size))[mask].any():
        raise DecodeError(f"token ids must lie in [0, {config.embedding_size})")
    check_no_mask_in_prompts(ids, mask, config)
    longest = int(mask.sum(axis=1).max())
    tail = grid_tail(cfg.gen_length, cfg.block_length) if config.block_causal else 0  # blocks end on the grid
    if longest + cfg.gen_length + tail > config.max_sequence_length:
        raise DecodeError(f"prompt ({longest} tokens) + gen_length ({cfg.gen_length})"
                          + (f" + up to {tail} positions to the block grid's end" if tail else "")
                          + f" exceeds the model's max_sequence_length ({config.max_sequence_length})")
    if config.block_causal:
        blocks = int(grid_blocks(mask.sum(axis=1), cfg.gen_length, cfg.block_length).max())
        check_grid_steps(cfg.rule, blocks, cfg.gen_length, cfg.block_length)
    if cfg.draws and rng is None:
        why = (f"{cfg.rule.name} draws its canvases' noise and samples" if cfg.traits.canvas
               else f"temperature={cfg.temperature} samples")
        raise DecodeError(f"{why}: pass rng=jax.random.key(seed)")
    P = ids.shape[1]
    bucket = -(-P // cfg.prompt_bucket) * cfg.prompt_bucket
    if config.block_causal:  # room left of every row's first decoded block for the block before it (cache.py)
        bucket = max(bucket, 2 * cfg.block_length)
    bucket = min(bucket, config.max_sequence_length - cfg.gen_length - tail)  # never pad past the model's limit
    pad = max(bucket - P, 0)
    ids = np.pad(ids, ((0, 0), (pad, 0)), constant_values=config.pad_token_id).astype(np.int32)
    mask = np.pad(mask, ((0, 0), (pad, 0)))
    return ids, mask, pad


class Placement(Protocol):
    """Where one batch's loop runs, and how its rows are laid out there."""

    kind: str  # names the program in compile_cache.compiled_programs()
    local: bool  # its devices are this process's only (a mesh may span processes, whose programs must match)

    def rows(self, batch: int) -> int:
        """Rows the program runs for a batch of `batch` (padded with copies of row 0 to fill the devices)."""
        ...

    def place(self, denoiser, ids: np.ndarray, mask: np.ndarray, key: jax.Array | None, rule, draws
              ) -> tuple[Any, tuple]:
        """(denoiser, program inputs) on the devices, from host inputs of `rows` rows: `key` one per batch (a data
        shard takes its own), `rule` and `draws` (a canvas rule's PromptDraws, or None) trees of per-row arrays."""
        ...

    def lower(self, loop_fn: Callable, denoiser, inputs: tuple):
        """`loop_fn(denoiser, ids, mask, key, rule, draws) -> LoopOutput`, lowered for these inputs."""
        ...

    def fetch(self, out: LoopOutput, batch: int) -> LoopOutput:
        """The output on the host: NumPy rows in input order (padding dropped), passes as the largest count."""
        ...


@dataclasses.dataclass(frozen=True)
class OneDevice:
    """The whole batch in one program on the default device."""

    kind = "decode/one-device"
    local = True

    def rows(self, batch):
        return batch

    def place(self, denoiser, ids, mask, key, rule, draws):
        return denoiser, (ids, mask, key, rule, draws)

    def lower(self, loop_fn, denoiser, inputs):
        return jax.jit(loop_fn).lower(denoiser, *inputs)

    def fetch(self, out, batch):
        return LoopOutput(np.asarray(out.x), np.asarray(out.nfe), int(out.passes), int(out.full_passes),
                          jax.tree.map(np.asarray, out.record), jax.tree.map(np.asarray, out.remasks),
                          jax.tree.map(np.asarray, out.edits), jax.tree.map(np.asarray, out.indels))


def pad_rows(a, rows: int) -> np.ndarray:
    """`a` [B, ...] padded to `rows` rows with copies of row 0 (a valid prompt with valid settings)."""
    a = np.asarray(a)
    return np.concatenate([a, np.repeat(a[:1], rows - a.shape[0], axis=0)]) if rows > a.shape[0] else a


def check_slots(slots) -> int | None:
    if slots is None:
        return None
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise DecodeError(f"slots={slots!r} must be a positive whole number (rows the loop holds at once), or None "
                          "(all prompts in one fixed batch)")
    return int(slots)


def check_canvas_noise(noise, cfg: DecodeConfig, config: ModelConfig, batch: int) -> np.ndarray | None:
    """`canvas_noise` as int32 [B, J, N + 1, C] (J canvases, N the rule's most passes a canvas), or None; refused in
    one line where it cannot apply."""
    if noise is None:
        return None
    if not cfg.traits.canvas:
        raise DecodeError(f"canvas_noise is a canvas rule's (a uniform-noise canvas model); {cfg.rule.name} draws none")
    J = cfg.gen_length // cfg.block_length
    want = (batch, J, cfg.pass_bound(config) // J + 1, cfg.block_length)
    noise = np.asarray(noise)
    if noise.shape != want or not np.issubdtype(noise.dtype, np.integer):
        raise DecodeError(f"canvas_noise must be token ids [batch, canvases, max_denoising_steps + 1, block_length] = "
                          f"{list(want)}; got {noise.dtype} {list(noise.shape)}")
    if noise.size and (noise.min() < 0 or noise.max() >= config.vocab_size):
        raise DecodeError(f"canvas_noise holds ids outside [0, {config.vocab_size})")
    return noise.astype(np.int32)


def decoding_denoiser(model, cfg: DecodeConfig):
    """The model's denoiser, attending on the decoding block's grid when its grid follows the decoding block
    (`ModelConfig.flexible_block`, LLaDA2) rather than the block it was trained with."""
    config = model.config
    if config.block_causal and config.flexible_block and cfg.block_length != config.block_size:
        return model.denoiser.replace(config=dataclasses.replace(config, block_size=cfg.block_length))
    return model.denoiser


class Program(NamedTuple):
    """One generation program, assembled on the host before anything is placed: what `run` compiles and runs, and
    what `ll.lower_generate` lowers from shapes alone."""

    loop_fn: Callable  # (denoiser, ids, mask, key, rule, draws) -> LoopOutput
    denoiser: Any  # the model's denoiser (not yet placed)
    inputs: tuple  # host arrays: (ids, mask, key, rule rows, draws), `rows` rows
    kind: str  # names the program in compile_cache.compiled_programs()
    key: Hashable  # what the compiled program depends on besides the denoiser's and inputs' shapes
    loop: LoopSettings
    batch: int  # B: prompt rows asked for (after bucketing)
    prompt_length: int  # P: the bucketed prompt length the program runs
    pad: int  # columns of left padding the bucket added
    per_shard: int | None  # slots per data shard (None: all rows at once)


def assemble(model, ids, mask, cfg: DecodeConfig, rng, *, placement: Placement, trace: bool = False,
             slots: int | None = None, canvas_noise=None) -> Program:
    """Inputs checked and bucketed, the rule's rows and draws made, the loop's settings chosen: the program `run`
    runs, before `placement` puts anything on a device."""
    missing = [a for a in ("config", "denoiser", "special") if not hasattr(model, a)]
    if missing:
        raise DecodeError(f"generate takes a model with config, denoiser and special (an ll.Model from ll.load); "
                          f"{type(model).__name__} has no {', '.join(missing)}")
    slots = check_slots(slots)
    if not isinstance(trace, (bool, np.bool_)):
        raise DecodeError(f"trace={trace!r} must be True or False")
    cfg = check_config(cfg)
    ids_b, mask_b, pad = prepare_inputs(ids, mask, cfg, model.config, rng)
    B, P = ids_b.shape
    if cfg.traits.canvas:
        model.denoiser.check_prompt(ids_b)  # what the canvas model cannot take (image tokens), in one line
    noise = check_canvas_noise(canvas_noise, cfg, model.config, B)
    rule = cfg.rule
    rows = placement.rows(B)
    shards = placement.rows(1)  # rows are padded to a multiple of the data shards
    per_shard = None if slots is None or -(-slots // shards) >= rows // shards else -(-slots // shards)
    # the rule's and the cache policy's settings, one value per row: inputs of the program
    rule_rows = jax.tree.map(lambda a: pad_rows(a, rows),
                             PerRow(rule.with_rows(B), cfg.loop_policy(model.config).with_rows(B)))
    loop = cfg.loop_settings(trace, model.config)
    special = model.special
    # A canvas rule's draws are per prompt (decode/draws.py), split with the rows: the same on every placement. A
    # masked rule's sampling key is per batch (each data shard its own); greedy decoding draws nothing: no key.
    draws = jax.tree.map(lambda a: pad_rows(a, rows), prompt_draws(rng, B, noise)) if cfg.traits.canvas else None
    key = rng if cfg.draws and draws is None else None
    # A caller's progress listener (decode/progress.py), on this process's devices only: a mesh may span processes,
    # whose programs must be the same.
    report = per_shard is not None and progress.listening() and placement.local
    loop_fn = (functools.partial(decode_loop, loop=loop, special=special) if per_shard is None else
               functools.partial(decode_slots, loop=loop, special=special, slots=per_shard, report=report))
    kind = placement.kind if per_shard is None else f"{placement.kind}/slots"
    return Program(loop_fn, decoding_denoiser(model, cfg),
                   (pad_rows(ids_b, rows), pad_rows(mask_b, rows), key, rule_rows, draws), kind,
                   (placement, loop, special, per_shard, report), loop, B, P, pad, per_shard)


def run(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), rng: jax.Array | None = None, *,
        placement: Placement = OneDevice(), trace: bool = False, slots: int | None = None,
        canvas_noise=None) -> Generation:
    """Decode left-padded prompts (ids [B, Lp], mask [B, Lp]) with one compiled loop on `placement`: all B rows at
    once, or, with `slots=S < B`, S rows at a time, each finished row's slot taking the next prompt inside the
    loop (decode/slots.py; on several data shards, ceil(S / shards) slots per shard). Outputs are in prompt
    order either way, and a prompt's tokens do not depend on which. `canvas_noise` [B, J, N + 1, C] (a canvas
    rule, one device): the uniform draws, supplied, one per prompt (decode/draws.py)."""
    program = assemble(model, ids, mask, cfg, rng, placement=placement, trace=trace, slots=slots,
                       canvas_noise=canvas_noise)
    B, P, pad, loop = program.batch, program.prompt_length, program.pad, program.loop
    denoiser, inputs = placement.place(program.denoiser, *program.inputs)
    program_key: Hashable = (*program.key, signature(denoiser), signature(inputs))
    compiled, compile_s = compile_once(program.kind, program_key,
                                       lambda: placement.lower(program.loop_fn, denoiser, inputs),
                                       shapes=tuple(np.shape(a) for a in jax.tree.leaves(inputs)))
    t0 = time.perf_counter()
    out = placement.fetch(compiled(denoiser, *inputs), B)  # waits for the device
    seconds = time.perf_counter() - t0
    out = out._replace(x=out.x[:, :P + cfg.gen_length])  # a block grid's tail past gen_length is not returned
    # A row stopped by the bound still holds masks (a finished row holds none, its early-stop fill included). A
    # canvas has no masks: its rule's bound (max_denoising_steps a canvas) always lets a row finish.
    hit_bound = (np.zeros(B, bool) if loop.traits.canvas else
                 np.any(np.asarray(out.x)[:, P:] == model.special.mask, axis=1))
    rule = cfg.rule
    shards = placement.rows(1)
    return Generation(tokens=out.x[:, pad:], nfe=out.nfe, forward_passes=out.passes, full_passes=out.full_passes,
                      prompt_length=P - pad, seconds=seconds, compile_seconds=compile_s,
                      trace=loop.recorder.to_host(out.record, out.x, out.nfe, P, rule.clause_names,
                                                  loop.traits.remask_names, loop.traits.edit_names),
                      hit_bound=hit_bound, remasks=None if isinstance(out.remasks, tuple) else out.remasks,
                      edits=counts(out.edits, B), inserts=counts(out.indels[:1], B), deletes=counts(out.indels[1:], B),
                      slots=placement.rows(B) if program.per_shard is None else program.per_shard * shards)


def counts(counted, batch: int) -> np.ndarray:
    """A per-row count the loop kept (an array, or the first of a tuple of them), or zeros [batch] where it kept none
    (the rule never edits, inserts, drops)."""
    if isinstance(counted, tuple):
        counted = counted[0] if counted else None
    return np.zeros(batch, np.int32) if counted is None else np.asarray(counted, np.int32)


def generate(model, ids, mask=None, cfg: DecodeConfig = DecodeConfig(), rng: jax.Array | None = None, *,
             trace: bool = False, slots: int | None = None, canvas_noise=None) -> Generation:
    """Decode a batch of left-padded prompts on one device (see `run`; `ll.generate` also takes a mesh).

    `trace=True` also returns `out.trace` (see localleap_jax.trace): per row and pass, the prediction
    and confidence at every generated position and what committed by which clause. It costs, per row,
    S x G x (4 + 4 + 1) bytes plus the LM head over the generated region at every pass: at LLaDA-8B's
    gen_length 256, 0.6 MB per row, and 256 x 126464 fp32 logits (129 MB) per row and pass in flight.
    With tracing off the program carries none of it. `slots`, `canvas_noise`: see `run`."""
    return run(model, ids, mask, cfg, rng, trace=trace, slots=slots, canvas_noise=canvas_noise)
