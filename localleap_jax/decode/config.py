"""`DecodeConfig`: what a generation is asked to do, validated before anything compiles.

The rule is resolved once, at construction (`strategy`: a rule object or a spec string such as "eb:gamma=0.01";
`cfg.rule` is the object), and its static traits read once (`cfg.traits`, `rules.traits_of`). The rule's settings
become inputs of the compiled program (one value per row); everything else that shapes the program is its
compile-time part, `loop_settings()`, which assembles the loop's pieces: the cache policy, the stop policy, the
recorder and the rule's traits.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import numpy as np

from localleap_jax import rules
from localleap_jax.decode.cache import (BIDIRECTIONAL_CACHES, CACHE_POLICIES, CANVAS_CACHES, ProbedNoCache,
                                       SoftNoCache, SubBlockCache, policy_from_json, policy_to_json)
from localleap_jax.decode.cache import resolve as resolve_cache
from localleap_jax.decode.canvas import grid_tail
from localleap_jax.decode.loop import LoopSettings
from localleap_jax.decode.recorder import NoRecorder, TraceRecorder
from localleap_jax.decode.step import Scoring
from localleap_jax.decode.stop import EndAtEos, NeverStop, StopAtEos
from localleap_jax.families import FAMILIES
from localleap_jax.rules import DecodeError, RuleTraits
from localleap_jax.rules.registry import value_to_json


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    # A rule object (ll.rule(...), ll.stateless(fn)), or a name / spec string such as "eb:gamma=0.01": resolved at
    # construction (rules.resolve), so that `cfg.strategy` is the rule object from then on. The command lines' shared
    # flags (--kappa, ...) map onto it with rules.with_shared_settings.
    strategy: Any = "localleap"
    gen_length: int = 256
    block_length: int = 32
    temperature: float = 0.0  # 0: argmax; > 0: Gumbel-max sampling (needs rng)
    early_stop: bool = False  # a finished block holding EOS fills the rest with EOS and ends the row
    logits_eos_inf: bool = False  # LLaDA switch: never predict EOS
    confidence_eos_eot_inf: bool = False  # LLaDA switch: EOS/EOT predictions get confidence 0 (commit last)
    # "auto": the exact "block" cache for a block-diffusion model (SDAR), "encoder" for a uniform-noise canvas model
    # (DiffusionGemma), "none" for a bidirectional one; "prefix" | "dual": Fast-dLLM's approximate KV caches, and
    # the field's ("dllm_cache", "dkv", "d2cache", "vicinity"), for bidirectional models. A name, a spec string
    # ("dkv:reload_every=8") or a policy object (ll.cache(...)): resolved at construction, so that `cfg.cache` is
    # "auto" or the policy object from then on. See decode/cache/.
    cache: Any = "auto"
    prompt_bucket: int = 64  # prompts are left-padded to a multiple of this, to bound recompiles
    # The loop's bound on forward passes. None: the rule's own (`rule.pass_bound`): gen_length for a rule that only
    # commits (it commits a token per pass) and for WINO (a pass nets a token), 4 x gen_length for Saber, ReMDM's
    # schedule's exact count, blocks x (block_length + max_post_edit_steps + 1) for joint_threshold(_indel); a user's
    # revoking (or block-ending) rule gets gen_length unless it says more. Rows that reach it with masks left:
    # `out.hit_bound`.
    max_passes: int | None = None
    # The rule commits in sub-blocks of this many positions of each block, in order (Fast-dLLM v2's small blocks).
    # None: the model family's own (Fast-dLLM v2: 8; others have none); refused for a family without sub-blocks.
    sub_block_length: int | None = None

    def __new__(cls, *args, **fields):
        # The settings DecodeConfig once took beside a rule's name are the rule's own now: say so, not just TypeError.
        old = [k for k in rules.SHARED_SETTINGS if k in fields]
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in fields if k not in known and k not in old]
        if unknown:
            raise DecodeError(f"DecodeConfig has no field {unknown[0]!r}{_did_you_mean(unknown[0], known)}; its fields: "
                              f"{', '.join(known)}")
        if len(args) > len(known):
            raise DecodeError(f"DecodeConfig takes at most {len(known)} positional fields ({', '.join(known)}), "
                              f"got {len(args)}")
        if old:
            given = fields.get("strategy", args[0] if args else "localleap")
            name = given.split(":")[0] if isinstance(given, str) else "localleap"
            raise DecodeError(f"DecodeConfig takes no {', '.join(old)}: they are the rule's settings, "
                              f"DecodeConfig(strategy=ll.rule({name!r}, {', '.join(f'{k}=...' for k in old)})) or "
                              f"\"{name}:{','.join(f'{k}=...' for k in old)}\"; for the command lines' shared "
                              "flags, ll.rules.with_shared_settings(spec, kappa=...)")
        return super().__new__(cls)

    def __post_init__(self):
        # The one resolution: a bad strategy (unknown name or setting, not a rule, a trait the loop cannot run, an
        # update that cannot take the loop's arguments) is one DecodeError line here. The traits are kept beside
        # the fields (not one of them: they follow from the rule).
        rule, traits = rules.resolve(self.strategy)
        object.__setattr__(self, "strategy", rule)
        object.__setattr__(self, "_traits", traits)
        object.__setattr__(self, "cache", resolve_cache(self.cache))  # a bad name or setting: one DecodeError line
        self._check_fields()  # every field's type and range: one line here, not an error inside generate

    def _check_fields(self) -> None:
        """What each field must be, whatever the model: whole numbers, a finite temperature, switches that are True
        or False, a bound and sub-blocks that are positive."""
        def bad(msg):
            raise DecodeError(msg)
        for name in ("gen_length", "block_length", "prompt_bucket"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                bad(f"{name}={v!r} must be a whole number")
            if v <= 0:
                bad(f"{name}={v} must be positive")
        v = self.temperature
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not np.isfinite(v):
            bad(f"temperature={v!r} must be a finite number (0: argmax; > 0: sampling)")
        if v < 0:
            bad(f"temperature={v} must be >= 0 (0: argmax; > 0: sampling)")
        for name in ("early_stop", "logits_eos_inf", "confidence_eos_eot_inf"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                bad(f"{name}={getattr(self, name)!r} must be True or False")
        if self.max_passes is not None and (isinstance(self.max_passes, (bool, np.bool_)) or
                                            not isinstance(self.max_passes, (int, np.integer)) or self.max_passes < 1):
            bad(f"max_passes={self.max_passes!r} must be a positive whole number (or None: the rule's own bound)")
        S = self.sub_block_length
        if S is not None and (isinstance(S, (bool, np.bool_)) or not isinstance(S, (int, np.integer)) or S < 1):
            bad(f"sub_block_length={S!r} must be a positive whole number (or None: the family's)")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def rule(self):
        """The rule object this config decodes with (resolved at construction)."""
        return self.strategy

    @property
    def traits(self) -> RuleTraits:
        """The rule's static traits (region, probes, remask_names, resets_state, edit_names, ends_blocks), read once
        at construction."""
        return self._traits

    @property
    def draws(self) -> bool:
        """Whether a generation draws random numbers (it needs an rng): sampling, or a canvas rule (its noise)."""
        return self.temperature > 0 or self.traits.canvas

    def cache_mode(self, model=None) -> str:
        """The cache policy's name for a model (a ModelConfig, or None: not known yet)."""
        if self.cache != "auto":
            return self.cache.name
        if self.traits.canvas or model is not None and model.canvas_length:
            return "encoder"
        return "block" if model is not None and model.block_causal else "none"

    def cache_policy(self, model=None):
        """The cache policy object for a model ("auto" resolved)."""
        return self.cache if self.cache != "auto" else CACHE_POLICIES[self.cache_mode(model)]

    @property
    def cache_spec(self) -> str:
        """The cache as a spec string ("auto", "dual", "dkv:reload_every=8", ...)."""
        return self.cache if self.cache == "auto" else self.cache.spec()

    def loop_policy(self, model=None):
        """The policy the loop runs: the probed pass when the rule probes, the pass with a soft input when the rule
        feeds one, the sub-block cache with the family's sub-blocks, else the cache's."""
        S = self.sub_blocks(model)
        S = S if 0 < S < self.block_length else 0
        policy = self.cache_policy(model)
        return (ProbedNoCache() if self.traits.probes else SoftNoCache() if self.traits.soft_input
                else SubBlockCache(S) if policy.name == "subblock" else policy)

    def validate(self, model=None, *, canvas: bool = True) -> "DecodeConfig":
        """Refuse, in one line, anything that cannot run. `model` (a ModelConfig) adds the checks that depend
        on it: a block-diffusion model decodes its own blocks (block_length = its block_size, gen_length any);
        without it the canvas is checked as a bidirectional model's (whole blocks). `canvas=False` leaves out what
        depends on the canvas (for a caller that does not know the model yet: it checks once the model is known)."""
        def bad(msg):
            raise DecodeError(msg)
        grid = model is not None and model.block_causal
        self._check_fields()  # checked at construction; again here for a config whose fields were set since
        self._check_canvas(model, canvas)
        if grid:
            if self.block_length != model.block_size and not model.flexible_block:
                bad(f"this block-diffusion model attends in blocks of {model.block_size} (config.json block_size): "
                    f"block_length must be {model.block_size}, got {self.block_length} (a block of the loop is a "
                    "block of the model's attention)")
            if "block_causal" not in self.cache_policy(model).fits:
                bad(f"cache={self.cache_spec!r} approximates a bidirectional model's K/V; a block-diffusion model's "
                    "are exact: use cache='block' (what 'auto' picks) or 'none'")
        elif not self.traits.canvas:  # a canvas rule's canvas is checked by _check_canvas
            if model is not None and "bidirectional" not in self.cache_policy(model).fits:
                bad(f"cache={self.cache_spec!r} needs a block-diffusion model (block-causal attention); this one is "
                    f"bidirectional: use {', '.join(BIDIRECTIONAL_CACHES)}")
            if canvas and self.gen_length % self.block_length:
                bad(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")
        self._check_sub_blocks(model)
        # On a block grid the blocks per row depend on the prompt: `steps` is checked with it (check_grid_steps).
        shape = (None, None) if grid or not canvas else (self.gen_length, self.block_length)
        self.rule.validate(*shape)
        self._check_traits(model, grid, canvas)
        return self

    def _check_canvas(self, model, canvas: bool) -> None:
        """A canvas rule goes with a uniform-noise canvas model (DiffusionGemma) and the other rules with the
        masked ones; what a canvas rule's generation cannot take is refused (one line each)."""
        name, canvas_model = self.rule.name, model is not None and model.canvas_length > 0
        if not self.traits.canvas:
            if canvas_model:
                raise DecodeError(f"this model decodes uniform-noise canvases (no mask token): use a canvas rule "
                                  f"(entropy_bound, localleap_uniform), not {name}")
            if self.cache_mode() == "encoder":
                raise DecodeError("cache='encoder' is a uniform-noise canvas model's (DiffusionGemma) with a canvas "
                                  f"rule; {name} decodes masks: use {', '.join(BIDIRECTIONAL_CACHES + ('block',))}")
            return
        if model is not None and not canvas_model:
            raise DecodeError(f"{name} is a canvas rule, for a uniform-noise canvas model (DiffusionGemma); this model "
                              "decodes masks: use a masked rule (threshold, localleap, ...)")
        if self.cache != "auto" and "canvas" not in self.cache.fits:
            raise DecodeError(f"cache={self.cache_spec!r}: a canvas rule keeps its model's encoder K/V (cache "
                              f"{', '.join(repr(c) for c in CANVAS_CACHES)}, what 'auto' picks)")
        if self.temperature:
            raise DecodeError(f"temperature={self.temperature}: {name} samples at its own schedule (t_min, t_max); "
                              "leave DecodeConfig.temperature at 0")
        if self.early_stop or self.logits_eos_inf or self.confidence_eos_eot_inf:
            raise DecodeError(f"{name}: early_stop, logits_eos_inf and confidence_eos_eot_inf are the masked loop's "
                              "switches; a canvas model's rows always end on EOS")
        if self.sub_block_length is not None:
            raise DecodeError(f"sub_block_length={self.sub_block_length}: a canvas rule decodes whole canvases")
        if canvas and self.gen_length % self.block_length:
            raise DecodeError(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length} "
                              "(the canvases)")
        if canvas_model and self.block_length != model.canvas_length:
            raise DecodeError(f"this model denoises canvases of {model.canvas_length} tokens (config.json "
                              f"canvas_length): block_length must be {model.canvas_length}, got {self.block_length}")

    def sub_blocks(self, model=None) -> int:
        """The sub-block length the rule commits in (0: none, the block is the rule's): sub_block_length, or the
        model family's default."""
        if self.sub_block_length is not None:
            return int(self.sub_block_length)
        family = FAMILIES.get(model.family) if model is not None else None
        return family.sub_block_length if family is not None else 0

    def _check_sub_blocks(self, model) -> None:
        S, mode = self.sub_block_length, self.cache_mode(model)
        family = FAMILIES.get(model.family) if model is not None else None
        if S is not None:
            if family is not None and not family.sub_block_length:
                raise DecodeError(f"sub_block_length={S}: {family.title} decodes whole blocks (sub-blocks are "
                                  "Fast-dLLM v2's); leave it None")
        S = self.sub_blocks(model)
        if S and self.block_length % S:
            raise DecodeError(f"sub_block_length={S} does not divide block_length={self.block_length}")
        if S and (self.traits.region != "block" or self.traits.probes or self.traits.ends_blocks):
            raise DecodeError(f"{self.rule.name} sees more than the block or ends its own blocks: it cannot run in "
                              "sub-blocks")
        if mode == "subblock" and (not S or S >= self.block_length):
            raise DecodeError("cache='subblock' reuses a block's K/V between its sub-blocks: it needs sub-blocks "
                              "(a Fast-dLLM v2 model, sub_block_length < block_length); use 'block'")

    def _check_traits(self, model, grid: bool, canvas: bool) -> None:
        """What the rule's region, probes and pass bound need of the rest of the config (refused in one line)."""
        name, region, probes = self.rule.name, self.traits.region, self.traits.probes
        mode, policy = self.cache_mode(model), self.cache_policy(model)
        covering = ", ".join(repr(n) for n, p in CACHE_POLICIES.items() if p.region and "bidirectional" in p.fits)
        changes = ("takes commits back" if self.traits.revokes else "edits tokens" if self.traits.edits
                   else "rewrites its block" if self.traits.rewrites else None)
        if changes and not getattr(policy, "whole_block", True):
            raise DecodeError(f"{name} {changes}, reading the block's decoded positions; the '{mode}' cache computes "
                              "only some positions of the block: use 'none', 'prefix', 'dual', 'dllm_cache' or "
                              "'vicinity'")
        if self.traits.soft_input:
            if grid:
                raise DecodeError(f"{name} feeds each pass the previous pass's distribution over the whole canvas "
                                  "(iteration smoothing, dInfer's bidirectional path); this model is block-causal: use "
                                  "it on a bidirectional model (LLaDA, LLaDA-MoE, Dream)")
            if mode != "none":
                raise DecodeError(f"{name} feeds each pass an input embedding over the whole canvas: use cache 'none' "
                                  f"(what 'auto' picks), not '{mode}' (a cached pass recomputes only part of it)")
        if region != "block" or probes:
            if grid:
                raise DecodeError(f"{name} works on a bidirectional model's canvas; this model is block-causal")
            if region == "generated" and not policy.region:
                raise DecodeError(f"{name} sees the whole generated region: use cache {covering} (the "
                                  f"'{mode}' cache computes only the block)")
            if probes and mode != "none":
                raise DecodeError(f"{name} scores the block with each position hidden in the same pass (a probe "
                                  f"copy of the block): use cache 'none', not '{mode}'")
            if probes and model is not None and model.logits_shift:
                raise DecodeError(f"{name}'s probe copy needs a model that predicts a position from itself; this "
                                  "family predicts it from the one before (logits shift)")
        if canvas and not grid and self.max_passes is not None:
            need = self.rule.min_passes(self.gen_length, self.block_length)
            if self.max_passes < need:
                raise DecodeError(f"max_passes={self.max_passes} < the {need} passes {name} needs on this canvas "
                                  f"(gen_length {self.gen_length}, block_length {self.block_length}): it cannot finish")

    def pass_bound(self, model=None) -> int:
        """The loop's bound on passes: max_passes, or the rule's own when it takes commits back or ends its own
        blocks (0: the loop's default, one pass per generated position). On a block-diffusion model's grid (`model`,
        a ModelConfig) a row may decode up to the grid's tail past gen_length: the rule's bound covers those
        positions too (a row's blocks are then at most ceil((gen_length + tail) / block_length))."""
        if self.max_passes is not None:
            return int(self.max_passes)
        if not self.traits.own_bound:
            return 0
        span = self.gen_length
        if model is not None and model.block_causal:
            span += grid_tail(self.gen_length, self.block_length)
        return self.rule.pass_bound(span, self.block_length)

    def loop_settings(self, trace: bool = False, model=None) -> LoopSettings:
        """The compile-time part, assembled: the canvas, how logits are scored, the rule's traits and the loop's
        pieces (for `model`, a ModelConfig: its attention decides the block grid and what cache "auto" means).
        The cache policy is chosen in `loop_policy`: the probed pass when the rule probes, else the cache's (a
        canvas rule's: the encoder cache; its rows end on the model's EOS ids)."""
        S = self.sub_blocks(model)
        S = S if 0 < S < self.block_length else 0
        cache = self.loop_policy(model).static()  # its traced settings are inputs of the program (run.py)
        grid = bool(model is not None and model.block_causal)
        if self.traits.canvas and model is None:
            raise DecodeError(f"{self.rule.name} is a canvas rule: its loop needs the model (its EOS ids)")
        stop = (EndAtEos(model.end_ids, model.pad_token_id) if self.traits.canvas
                else StopAtEos() if self.early_stop else NeverStop())
        return LoopSettings(
            self.gen_length, self.block_length,
            Scoring(float(self.temperature), bool(self.logits_eos_inf), bool(self.confidence_eos_eot_inf)),
            cache=cache,
            stop=stop,
            recorder=TraceRecorder() if trace else NoRecorder(),
            block_grid=grid,
            max_passes=self.pass_bound(model),
            traits=self.traits,
            sub_block_length=S,
            free_tokens=grid and bool(model.logits_shift))

    def fingerprint(self) -> dict[str, Any]:
        """Everything in this config that changes the generated tokens, JSON-able (for resume keys)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("strategy", "prompt_bucket")
               and not (f.name == "sub_block_length" and self.sub_block_length is None)}  # resume keys as before
        return {**out, "cache": self.cache_spec, "rule": self.rule.spec()}

    def to_json(self) -> dict:
        """Every field, the rule with its exact settings (`rules.rule_to_json`): what another process rebuilds the
        same config from."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("strategy", "cache")}
        return {**{k: value_to_json(v) for k, v in fields.items()}, "cache": policy_to_json(self.cache),
                "rule": rules.rule_to_json(self.rule)}

    @classmethod
    def from_json(cls, data: dict) -> "DecodeConfig":
        fields = {k: v for k, v in data.items() if k not in ("rule", "cache")}
        return cls(strategy=rules.rule_from_json(data["rule"]), cache=policy_from_json(data.get("cache", "auto")),
                   **fields)


def _did_you_mean(given, choices) -> str:
    near = difflib.get_close_matches(given, choices, n=1) if isinstance(given, str) else []
    return f" (did you mean {near[0]!r}?)" if near else ""


def model_canvas(model, gen_length: int) -> dict[str, int]:
    """What a model fixes of the canvas when a caller leaves it to the model (`model`: a ModelConfig, or None),
    beside a default `gen_length`: a block-diffusion model decodes in blocks of its block_size; a uniform-noise
    canvas model (DiffusionGemma) in canvases of its canvas_length, gen_length rounded up to whole canvases (as
    transformers' generate rounds max_new_tokens). {}: nothing (a bidirectional masked model)."""
    if model is None:
        return {}
    if model.canvas_length:
        size = model.canvas_length
        return {"block_length": size, "gen_length": -(-int(gen_length) // size) * size}
    if model.block_causal:
        return {"block_length": model.block_size}
    return {}


def check_room(gen_length: int, max_sequence_length: int) -> None:
    """A canvas of gen_length must leave a model of this length room for at least one prompt token."""
    if gen_length >= max_sequence_length:
        raise DecodeError(f"gen_length={gen_length} leaves no room for a prompt: the model's "
                          f"max_sequence_length is {max_sequence_length}")


def grid_blocks(prompt_lengths, gen_length: int, block_length: int) -> np.ndarray:
    """Blocks each row decodes on its own block grid (canvas.py): ceil((n % T + G) / T) for an n-token prompt."""
    offset = np.asarray(prompt_lengths) % block_length
    return -(-(offset + gen_length) // block_length)


_ENCODE_HINT = "encode prompts first: ids, mask = model.tokenizer.encode_batch(prompts)"


def _rectangular(value, what: str) -> np.ndarray:
    """`value` as an array, refused in one line when it is None, text, or rows of different lengths."""
    if value is None:
        raise DecodeError(f"{what} is None; expected token ids [batch, prompt_length] ({_ENCODE_HINT})")
    if isinstance(value, (str, bytes, bytearray)):
        raise DecodeError(f"{what} is {type(value).__name__}, not token ids [batch, prompt_length] ({_ENCODE_HINT})")
    if isinstance(value, (list, tuple)):
        lengths = []
        for i, row in enumerate(value):
            if row is None or isinstance(row, (str, bytes, bytearray)):
                raise DecodeError(f"{what}[{i}] is {type(row).__name__}, not a row of token ids ({_ENCODE_HINT})")
            lengths.append(len(row) if hasattr(row, "__len__") else None)
        if len(set(lengths)) > 1:
            first = lengths[0]
            other = next(i for i, n in enumerate(lengths) if n != first)
            unit = "ids" if what == "ids" else "values"
            raise DecodeError(f"{what} is ragged (row 0 has {first} {unit}, row {other} has {lengths[other]}): left-pad "
                              "the rows and pass their mask (localleap_jax.tokenizer.left_pad(rows, pad_id), or "
                              f"{_ENCODE_HINT.split(': ')[1]})")
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:  # raggedness deeper down
        raise DecodeError(f"{what} is not a rectangular array ({str(e).splitlines()[0] if str(e) else e!r})") from None


def prompt_arrays(ids, mask) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) as numpy arrays of the user's values (mask None: all True), refused in one line naming what
    was given when either is None, text, or ragged. Shapes and dtypes are checked by the caller."""
    ids = _rectangular(ids, "ids")
    mask = np.ones(ids.shape, bool) if mask is None else _rectangular(mask, "mask").astype(bool)
    return ids, mask
