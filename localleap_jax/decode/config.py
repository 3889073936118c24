"""`DecodeConfig`: what a generation is asked to do, validated before anything compiles.

The rule's settings become inputs of the compiled program (one value per row); everything else that shapes
the program is its compile-time part, `loop_settings()`, which chooses the loop's pieces: the cache policy,
the stop policy and the recorder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import numpy as np

from localleap_jax import rules
from localleap_jax.decode.cache import (BIDIRECTIONAL_CACHES, BLOCK_CAUSAL_CACHES, CACHE_MODES, CACHE_POLICIES,
                                       ProbedNoCache)
from localleap_jax.decode.loop import LoopSettings
from localleap_jax.decode.recorder import NoRecorder, TraceRecorder
from localleap_jax.decode.step import Scoring
from localleap_jax.decode.stop import NeverStop, StopAtEos
from localleap_jax.rules import DecodeError
from localleap_jax.rules.base import check_settings
from localleap_jax.rules.registry import value_to_json

LEGACY_SETTINGS = ("kappa", "tau", "radius", "steps")


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
    # "auto": the exact "block" cache for a block-diffusion model (SDAR), "none" for a bidirectional one;
    # "prefix" | "dual": Fast-dLLM's approximate KV caches (bidirectional models). See decode/cache.py.
    cache: str = "auto"
    prompt_bucket: int = 64  # prompts are left-padded to a multiple of this, to bound recompiles
    # The loop's bound on forward passes. None: the rule's own (`rule.pass_bound`): gen_length for a rule that only
    # commits (it commits a token per pass) and for WINO (a pass nets a token), 4 x gen_length for Saber, ReMDM's
    # schedule's exact count; a user's revoking rule gets gen_length unless it says more. Rows that reach it stop
    # with masks left: `out.hit_bound`.
    max_passes: int | None = None

    def __post_init__(self):
        legacy = [k for k in LEGACY_SETTINGS if getattr(self, k) is not None]
        if legacy:  # stacklevel 3: the caller of DecodeConfig(...), past __init__
            name = self.strategy if isinstance(self.strategy, str) else getattr(self.strategy, "name", "localleap")
            warnings.warn(f"DecodeConfig({', '.join(f'{k}=...' for k in legacy)}) is deprecated: set them on the rule, "
                          f"DecodeConfig(strategy=ll.rule({name.split(':')[0]!r}, {', '.join(f'{k}=...' for k in legacy)}))",
                          DeprecationWarning, stacklevel=3)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def rule(self):
        """The rule object this config decodes with (a name plus the deprecated fields, mapped)."""
        legacy = {k: getattr(self, k) for k in LEGACY_SETTINGS if getattr(self, k) is not None}
        if not isinstance(self.strategy, str):
            if isinstance(self.strategy, type) or not callable(getattr(self.strategy, "update", None)):
                what = (f"the class {self.strategy.__name__} (pass an instance: {self.strategy.__name__}(...))"
                        if isinstance(self.strategy, type) else f"{type(self.strategy).__name__} {self.strategy!r}")
                raise DecodeError(f"strategy must be a rule (ll.rule(...), ll.stateless(fn)) or a rule name; got {what}")
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

    def cache_mode(self, model=None) -> str:
        """The cache policy's name for a model (a ModelConfig, or None: not known yet)."""
        if self.cache != "auto":
            return self.cache
        return "block" if model is not None and model.block_causal else "none"

    def validate(self, model=None, *, canvas: bool = True) -> "DecodeConfig":
        """Refuse, in one line, anything that cannot run. `model` (a ModelConfig) adds the checks that depend
        on it: a block-diffusion model decodes its own blocks (block_length = its block_size, gen_length any).
        `canvas=False` leaves out what depends on the block length (for a caller that fills it in from the
        model once it is loaded)."""
        def bad(msg):
            raise DecodeError(msg)
        grid = model is not None and model.block_causal
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
        if self.cache != "auto" and self.cache not in CACHE_POLICIES:
            bad(f"unknown cache {self.cache!r}; choose from auto, {', '.join(CACHE_MODES)}")
        if self.gen_length <= 0 or self.block_length <= 0:
            bad(f"gen_length ({self.gen_length}) and block_length ({self.block_length}) must be positive")
        if grid:
            if self.block_length != model.block_size:
                bad(f"this block-diffusion model attends in blocks of {model.block_size} (config.json block_size): "
                    f"block_length must be {model.block_size}, got {self.block_length} (a block of the loop is a "
                    "block of the model's attention)")
            if self.cache_mode(model) not in BLOCK_CAUSAL_CACHES:
                bad(f"cache={self.cache!r} approximates a bidirectional model's K/V; a block-diffusion model's are "
                    "exact: use cache='block' (what 'auto' picks) or 'none'")
        else:
            if model is not None and self.cache_mode(model) not in BIDIRECTIONAL_CACHES:
                bad(f"cache={self.cache!r} needs a block-diffusion model (block-causal attention); this one is "
                    f"bidirectional: use {', '.join(BIDIRECTIONAL_CACHES)}")
            if canvas and self.gen_length % self.block_length:
                bad(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")
        if self.temperature < 0:
            bad(f"temperature={self.temperature} must be >= 0")
        if self.prompt_bucket <= 0:
            bad(f"prompt_bucket={self.prompt_bucket} must be positive")
        if self.max_passes is not None and (isinstance(self.max_passes, bool) or
                                            not isinstance(self.max_passes, (int, np.integer)) or self.max_passes < 1):
            bad(f"max_passes={self.max_passes!r} must be a positive whole number (or None: the rule's own bound)")
        # The deprecated fields keep their range checks even where the named rule ignores them.
        legacy = {k: getattr(self, k) for k in ("kappa", "tau", "radius") if getattr(self, k) is not None}
        check_settings(rules.LocalLeap(**legacy))
        if self.kappa is not None and self.tau is not None and self.tau > self.kappa:
            bad(f"tau={self.tau} > kappa={self.kappa}: the relaxed threshold must not be stricter than the anchor")
        # On a block grid the blocks per row depend on the prompt: `steps` is checked with it (check_grid_steps).
        shape = (None, None) if grid or not canvas else (self.gen_length, self.block_length)
        rules.LowConfidence(self.steps).validate(*shape)
        rule = self.rule.validate(*shape)
        self._check_revoking(rule, model, grid, canvas)
        return self

    def _check_revoking(self, rule, model, grid: bool, canvas: bool) -> None:
        """What a rule's region, probes and pass bound need of the rest of the config (refused in one line)."""
        region, probes = getattr(rule, "region", "block"), getattr(rule, "probes", False)
        names = getattr(rule, "remask_names", ())
        if region not in ("block", "generated"):
            raise DecodeError(f"{rule.name}: region={region!r}; a rule's region is 'block' or 'generated'")
        if probes and region != "block":
            raise DecodeError(f"{rule.name}: probes score the current block; a rule with region {region!r} cannot "
                              "have them")
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            raise DecodeError(f"{rule.name}: remask_names={names!r} must be a tuple of names, e.g. ('doubt',)")
        mode = self.cache_mode(model)
        if region != "block" or probes:
            if grid:
                raise DecodeError(f"{rule.name} works on a bidirectional model's canvas; this model is block-causal")
            if region == "generated" and mode not in ("none", "prefix"):
                raise DecodeError(f"{rule.name} sees the whole generated region: use cache 'none' or 'prefix' (the "
                                  f"'{mode}' cache computes only the block)")
            if probes and mode != "none":
                raise DecodeError(f"{rule.name} scores the block with each position hidden in the same pass (a probe "
                                  f"copy of the block): use cache 'none', not '{mode}'")
            if probes and model is not None and model.logits_shift:
                raise DecodeError(f"{rule.name}'s probe copy needs a model that predicts a position from itself; this "
                                  "family predicts it from the one before (logits shift)")
        if canvas and not grid and self.max_passes is not None:
            need = rule.min_passes(self.gen_length, self.block_length)
            if self.max_passes < need:
                raise DecodeError(f"max_passes={self.max_passes} < the {need} passes {rule.name} needs on this canvas "
                                  f"(gen_length {self.gen_length}, block_length {self.block_length}): it cannot finish")

    def pass_bound(self) -> int:
        """The loop's bound on passes: max_passes, or the rule's own when it takes commits back (0: the loop's
        default, one pass per generated position)."""
        if self.max_passes is not None:
            return int(self.max_passes)
        rule = self.rule
        return rule.pass_bound(self.gen_length, self.block_length) if getattr(rule, "remask_names", ()) else 0

    def loop_settings(self, trace: bool = False, model=None) -> LoopSettings:
        """The compile-time part: the canvas, how logits are scored, and the loop's pieces (for `model`, a
        ModelConfig: its attention decides the block grid and what cache "auto" means; a rule with probes runs
        the probed pass)."""
        cache = CACHE_POLICIES[self.cache_mode(model)]
        if getattr(self.rule, "probes", False):
            cache = ProbedNoCache()
        return LoopSettings(
            self.gen_length, self.block_length,
            Scoring(float(self.temperature), bool(self.logits_eos_inf), bool(self.confidence_eos_eot_inf)),
            cache=cache,
            stop=StopAtEos() if self.early_stop else NeverStop(),
            recorder=TraceRecorder() if trace else NoRecorder(),
            block_grid=bool(model is not None and model.block_causal),
            max_passes=self.pass_bound())

    def fingerprint(self) -> dict[str, Any]:
        """Everything in this config that changes the generated tokens, JSON-able (for resume keys)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("strategy", "prompt_bucket", *LEGACY_SETTINGS)}
        return {**out, "rule": self.rule.spec()}

    def to_json(self) -> dict:
        """Every field, the rule resolved (names and the deprecated fields folded in) with its exact settings
        (`rules.rule_to_json`): what another process rebuilds the same config from."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("strategy", *LEGACY_SETTINGS)}
        return {**{k: value_to_json(v) for k, v in fields.items()}, "rule": rules.rule_to_json(self.rule)}

    @classmethod
    def from_json(cls, data: dict) -> "DecodeConfig":
        fields = {k: v for k, v in data.items() if k != "rule"}
        return cls(strategy=rules.rule_from_json(data["rule"]), **fields)


@contextlib.contextmanager
def _shared_settings_route():
    """kappa/tau/radius/steps given the command-line way (--kappa, model_args kappa=) are the documented shared
    settings of the rules that take them: the same mapping as the deprecated Python form, without its warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def with_shared_settings(**fields) -> DecodeConfig:
    """A DecodeConfig from command-line style fields (see `_shared_settings_route`)."""
    with _shared_settings_route():
        return DecodeConfig(**fields)


def replaced(cfg: DecodeConfig, **changes) -> DecodeConfig:
    """`dataclasses.replace` for a config whose shared settings were given the command-line way."""
    with _shared_settings_route():
        return dataclasses.replace(cfg, **changes)


def _settings_taken(cls) -> set[str]:
    """The deprecated fields a rule registered under a name takes (a rule given as a function takes none)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if "setting" in f.metadata}
    return set()


def check_room(gen_length: int, max_sequence_length: int) -> None:
    """A canvas of gen_length must leave a model of this length room for at least one prompt token."""
    if gen_length >= max_sequence_length:
        raise DecodeError(f"gen_length={gen_length} leaves no room for a prompt: the model's "
                          f"max_sequence_length is {max_sequence_length}")


def grid_blocks(prompt_lengths, gen_length: int, block_length: int) -> np.ndarray:
    """Blocks each row decodes on its own block grid (canvas.py): ceil((n % T + G) / T) for an n-token prompt."""
    offset = np.asarray(prompt_lengths) % block_length
    return -(-(offset + gen_length) // block_length)


def check_grid_steps(rule, prompt_lengths, gen_length: int, block_length: int) -> None:
    """On a block grid a rule's `steps` (the total over a row's decoded blocks) must give each block one."""
    steps = getattr(rule, "steps", None)
    if steps is None:
        return
    blocks = int(grid_blocks(prompt_lengths, gen_length, block_length).max())
    low = int(np.min(np.asarray(steps)))
    if low < blocks:
        raise DecodeError(f"{rule.name}: steps={low} < the {blocks} blocks a row decodes (gen_length {gen_length} "
                          f"on the model's grid of {block_length}): every block needs a step")


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
