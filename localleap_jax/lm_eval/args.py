"""Model arguments: what `--model_args` (or LocalLeapLM's keywords) may hold, each value parsed and checked,
every DecodeConfig field included. Nothing here loads anything, so a command line checks them first."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from localleap_jax.cli import DEFAULT_CHECKPOINT, DTYPES
from localleap_jax.errors import ModelArgsError
from localleap_jax.decode import DecodeConfig, DecodeError, check_room, model_canvas
from localleap_jax.decode.cache import CACHES
from localleap_jax.families import family_of
from localleap_jax.likelihood import ESTIMATOR_NAMES, LikelihoodConfig, LikelihoodError
from localleap_jax.partition import parse_mesh
from localleap_jax.rules import RULES, SHARED_SETTINGS, with_shared_settings
from localleap_jax.rules.base import make_spec, settings_of
from localleap_jax.rules.registry import parse_spec, parse_value, split_specs
from localleap_jax.rules.sources import RulesError, load_rules


def default_dtype() -> str:
    """What dtype "auto" means here: fp32 on CPU, bf16 on an accelerator."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


# Each parser takes the value as given (a Python value, or what lm-eval made of a --model_args string)
# and returns the value to use, or raises ValueError saying what is expected.


def _as_bool(value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise ValueError(f"expected true or false, got {value!r}")


def _as_int(value, low: int | None = None, high: int | None = None) -> int:
    # lm-eval reads some integers ("-1") as floats: a float holding a whole number is that integer.
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, str)):
        raise ValueError(f"expected an integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None
    if (low is not None and number < low) or (high is not None and number > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"expected an integer {bounds}, got {number}")
    return number


def _as_float(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating, str)):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _as_str(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _as_optional(parse: Callable) -> Callable:
    return lambda value: None if value is None else parse(value)


def _as_batch_size(value) -> int:
    # lm-eval's "auto"/"auto:N" searches for the largest batch that fits; a fixed default serves here.
    if value is None or (isinstance(value, str) and value.strip().lower().split(":")[0] == "auto"):
        return 8
    return _as_int(value, low=1)


def _as_dtype(value) -> str:
    if value not in DTYPES:  # the command lines' --dtype choices (float16: XLA's CPU backend cannot run it)
        raise ValueError(f"expected {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {value!r}")
    return value


def _as_guidance(value) -> float:
    number = _as_float(value)
    if number < 0:
        raise ValueError(f"expected a number >= 0 (0: no guidance), got {number}")
    return number


def _as_estimator(value):
    if value is None or value in ESTIMATOR_NAMES:
        return value
    raise ValueError(f"expected one of {', '.join(ESTIMATOR_NAMES)}, got {value!r}")


def _ignored(value):
    return value


def _as_mesh(value):
    """'data=2;model=4' (';' between the axes: lm-eval splits model_args at commas) or a Mesh object."""
    if value is None or isinstance(value, Mesh):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected data=D;model=M, got {value!r}")
    try:
        parse_mesh(value)
    except DecodeError as e:
        raise ValueError(str(e)) from None
    return value


# The adapter's own settings (every DecodeConfig field is a setting too): name -> (parse, default).
ADAPTER_ARGS: dict[str, tuple[Callable, Any]] = {
    "checkpoint": (_as_optional(_as_str), DEFAULT_CHECKPOINT),  # the embedded chain model; "embedded": tiny-math
    "batch_size": (_as_batch_size, 8),
    # Continuous batching: the loop holds `slots` rows (default: batch_size) and each compiled call takes `queue`
    # prompts (default: 4 x slots), a finished row's slot taking the next one inside the loop. queue == slots:
    # fixed batches.
    "slots": (_as_optional(functools.partial(_as_int, low=1)), None),
    "queue": (_as_optional(functools.partial(_as_int, low=1)), None),
    "dtype": (_as_dtype, "auto"),
    "chat": (_as_bool, True),
    "compile_cache": (_as_bool, True),
    "stats_path": (_as_optional(_as_str), None),
    "seed": (functools.partial(_as_int, low=0, high=2**32 - 1), 0),
    "progress": (_as_bool, True),
    "truncate_fewshot": (_as_bool, False),
    "fewshot_delimiter": (_as_str, "\n\n"),  # lm-eval's default separator between few-shot examples
    # A user's rule files or modules, ';' between them (lm-eval splits model_args at commas), loaded before
    # `strategy` is read: rules=path/to/myrules.py;mypkg.rules,strategy=steady
    "rules": (_as_optional(_as_str), None),
    # Devices and processes: every process runs the same command; process 0 runs lm-eval, the others follow.
    "mesh": (_as_mesh, None),
    "coordinator": (_as_optional(_as_str), None),
    "num_processes": (_as_optional(functools.partial(_as_int, low=1)), None),
    "process_id": (_as_optional(functools.partial(_as_int, low=0)), None),
    # Log-likelihood requests (multiple-choice tasks): the authors' Monte-Carlo estimator (LikelihoodConfig).
    # lm-eval's --batch_size sets the generation batch only; the Monte-Carlo mini-batch is mc_batch_size (the
    # authors' scripts pass theirs through --batch_size: to reproduce a run made with --batch_size 8, give
    # mc_batch_size=8).
    "mc_num": (functools.partial(_as_int, low=1), LikelihoodConfig.mc_num),
    "mc_batch_size": (functools.partial(_as_int, low=1), LikelihoodConfig.batch_size),
    "cfg": (_as_guidance, LikelihoodConfig.cfg_scale),  # LLaDA's convention: un + (cfg + 1) (cond - un)
    "is_check_greedy": (_as_bool, False),  # LLaDA's suffix_greedy_prediction (L extra passes per request)
    "estimator": (_as_estimator, None),  # None: the family's own
    "add_bos_token": (_as_bool, False),  # Dream's option: prepend the BOS text to every context
    "max_batch_size": (_ignored, None),  # lm-eval passes these to every model; nothing here uses them
    "device": (_ignored, None),
}
# Python objects, for callers that build the LM themselves; never from a command line.
PYTHON_ONLY_ARGS = ("model", "on_batch", "answers_key")

_DECODE_PARSERS = {"int": functools.partial(_as_int, low=None), "float": _as_float, "bool": _as_bool, "str": _as_str,
                   "int | None": _as_optional(_as_int), "float | None": _as_optional(_as_float)}
# The rules' shared settings (rules.with_shared_settings), as the command lines' --kappa, --tau, --radius, --steps:
# each applies to a rule that takes it and never over the strategy's own spec.
_SHARED_PARSERS = {"kappa": _as_optional(_as_float), "tau": _as_optional(_as_float),
                   "radius": _as_optional(_as_int), "steps": _as_optional(_as_int)}
assert set(_SHARED_PARSERS) == set(SHARED_SETTINGS)


def _rule_settings(strategy) -> set[str]:
    """The settings the named rule takes (so `tau_kl=0.05` may follow `strategy=klass` in model_args:
    lm-eval splits model_args at commas, so a spec's second setting arrives as a key of its own)."""
    if not isinstance(strategy, str):
        return set()
    cls = RULES.get(parse_spec(strategy)[0]) if ":" in strategy or strategy in RULES else None
    return set(settings_of(cls())) if dataclasses.is_dataclass(cls) else set()


def _cache_settings(cache) -> set[str]:
    """The settings the named cache policy takes (`cache=dllm_cache:gen_interval=4,transfer_ratio=0.5` arrives as
    `cache=dllm_cache:gen_interval=4` and a key `transfer_ratio`: lm-eval splits model_args at commas)."""
    if not isinstance(cache, str):
        return set()
    cls = CACHES.get(parse_spec(cache)[0])
    return {f.name for f in dataclasses.fields(cls) if "setting" in f.metadata} if cls is not None else set()


def _decode_parser(field: dataclasses.Field) -> Callable:
    # Field annotations are strings (postponed annotations); an unfamiliar one passes the value through
    # and DecodeConfig judges it.
    return _DECODE_PARSERS.get(str(field.type), _ignored)


def refuse_python_only(given: dict[str, Any]) -> None:
    """Refuse the Python-only arguments (a loaded model, a callback, a resume key) in command-line model_args."""
    from_python = sorted(set(given) & set(PYTHON_ONLY_ARGS))
    if from_python:
        raise ModelArgsError(f"model_args {', '.join(from_python)} cannot be given on the command line")


def parse_model_args(given: dict[str, Any]) -> tuple[dict[str, Any], DecodeConfig]:
    """(adapter settings with defaults filled in, validated DecodeConfig) from model arguments.

    Every unknown name and every badly typed value is reported in one ModelArgsError, so a command
    line is fixed in one go; nothing is loaded here, so the command line can check it first."""
    decode_fields = {f.name: f for f in dataclasses.fields(DecodeConfig)}
    load_model_args_rules(given.get("rules"))
    try:
        rule_keys = (_rule_settings(given.get("strategy", DecodeConfig.strategy)) - set(decode_fields)
                     - set(SHARED_SETTINGS))
    except DecodeError as e:
        raise ModelArgsError(f"model_args strategy: {e}") from None
    try:
        cache_keys = _cache_settings(given.get("cache")) - set(decode_fields) - set(SHARED_SETTINGS) - rule_keys
    except DecodeError as e:
        raise ModelArgsError(f"model_args cache: {e}") from None
    known = sorted(set(ADAPTER_ARGS) | set(decode_fields) | set(SHARED_SETTINGS) | rule_keys | cache_keys)
    problems, settings, decode, shared, rule_extra, cache_extra = [], {}, {}, {}, {}, {}
    unknown = [name for name in given if name not in known]
    for name in unknown:
        near = difflib.get_close_matches(name, known, n=1)
        problems.append(f"unknown model_args key {name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    for name, value in given.items():
        if name in ADAPTER_ARGS:
            parse, target = ADAPTER_ARGS[name][0], settings
        elif name in decode_fields:
            parse, target = _decode_parser(decode_fields[name]), decode
        elif name in SHARED_SETTINGS:
            parse, target = _SHARED_PARSERS[name], shared
        elif name in rule_keys:
            parse, target = (lambda v: parse_value(v) if isinstance(v, str) else v), rule_extra
        elif name in cache_keys:
            parse, target = (lambda v: parse_value(v) if isinstance(v, str) else v), cache_extra
        else:
            continue
        try:
            target[name] = parse(value)
        except ValueError as e:
            problems.append(f"model_args {name}: {e}")
    if unknown:
        problems.append(f"the keys are {', '.join(known)}")
    if problems:
        raise ModelArgsError("; ".join(problems))
    settings = {name: settings.get(name, default) for name, (_, default) in ADAPTER_ARGS.items()}
    check_batching(settings["batch_size"], settings["slots"], settings["queue"])
    try:
        settings["likelihood"] = likelihood_config(settings)
    except LikelihoodError as e:
        raise ModelArgsError(f"model_args: {e}") from None
    if rule_extra:  # fold the rule's own settings into its spec: "klass:tau_c=0.5" + tau_kl=0.05
        name, spec_settings = parse_spec(decode.get("strategy", DecodeConfig.strategy))
        decode["strategy"] = make_spec(name, {**spec_settings, **rule_extra})
    if cache_extra:  # the cache's own settings, likewise: "dllm_cache:gen_interval=4" + transfer_ratio=0.5
        name, spec_settings = parse_spec(decode["cache"])
        decode["cache"] = make_spec(name, {**spec_settings, **cache_extra})
    try:
        # The canvas depends on the model, not known here: without a block_length or gen_length the model decides them
        # (a block-diffusion model's block, a canvas model's canvases), and given both, a block-diffusion model takes a
        # gen_length off its block (a bidirectional one does not). `fit_to_model` checks the canvas with the model
        # (from config.json, before any weight is read).
        rule = with_shared_settings(decode.pop("strategy", DecodeConfig.strategy), **shared)
        cfg = DecodeConfig(strategy=rule, **decode).validate(canvas=False)
    except DecodeError as e:
        unknown = str(e).startswith("unknown strategy")
        hint = "; a rule of your own: model_args rules=path/to/myrules.py" if unknown else ""
        raise ModelArgsError(f"model_args: {e}{hint}") from None
    return settings, cfg


def check_batching(batch_size: int, slots: int | None, queue: int | None,
                   names: tuple[str, str, str] = ("model_args batch_size", "model_args slots", "model_args queue")
                   ) -> tuple[int, int]:
    """(slots, queue): the rows the loop holds (default: batch_size) and the prompts per compiled call (default:
    4 x slots; equal to slots: fixed batches). A queue shorter than the slots would leave slots idle in every call:
    refused (ModelArgsError), `names` naming the settings as the caller's user gave them."""
    held = slots or batch_size
    if queue is not None and queue < held:
        b, s, q = names
        rows = f"{s} {held}" if slots else f"{b} {held} (the rows held without {s})"
        raise ModelArgsError(f"{q} {queue} is below {rows}: every compiled call would hold {held} rows for {queue} "
                             f"prompts, {held - queue} of them idle; give {q} >= {held} (equal: fixed batches; the "
                             f"default, 4 x the rows held, keeps them busy)")
    return held, (queue if queue is not None else 4 * held)


def load_model_args_rules(given) -> list[str]:
    """model_args rules: load each file or module (rules.sources.load_rules); a mistake is one ModelArgsError."""
    if given is None:
        return []
    if not isinstance(given, str):
        raise ModelArgsError(f"model_args rules: expected path/to/rules.py or a module name, got {given!r}")
    try:
        return load_rules(given)
    except RulesError as e:
        raise ModelArgsError(f"model_args rules {e}") from None


def likelihood_config(settings: dict[str, Any]) -> LikelihoodConfig:
    """The LikelihoodConfig the adapter's settings name (checked: mc_num a multiple of mc_batch_size, ...)."""
    if settings["mc_num"] % settings["mc_batch_size"]:
        raise LikelihoodError(f"mc_num={settings['mc_num']} must be a multiple of mc_batch_size="
                              f"{settings['mc_batch_size']} (the samples are drawn in whole mini-batches)")
    return LikelihoodConfig(mc_num=settings["mc_num"], batch_size=settings["mc_batch_size"],
                            cfg_scale=float(settings["cfg"]), seed=settings["seed"],
                            estimator=settings["estimator"]).validate()


def check_gen_length(cfg: DecodeConfig, max_sequence_length: int) -> None:
    """gen_length must leave a model of this length room for a prompt (a mistake in the model arguments)."""
    try:
        check_room(cfg.gen_length, max_sequence_length)
    except DecodeError as e:
        raise ModelArgsError(str(e)) from None


def with_checkpoint_defaults(cfg: DecodeConfig, path, given: dict[str, Any]) -> DecodeConfig:
    """`cfg` with the checkpoint's own evaluation canvas (its manifest's `eval_defaults`: the embedded models' gen 64,
    block 16) where the model arguments name none, as `eval_gsm8k.py` reads it; the papers' canvas otherwise."""
    from localleap_jax.checkpoint import read_manifest

    own = read_manifest(path).get("eval_defaults", {})
    canvas = {k: own[k] for k in ("gen_length", "block_length") if k in own and k not in given}
    return dataclasses.replace(cfg, **canvas) if canvas else cfg


def fit_to_model(cfg: DecodeConfig, config, given: dict[str, Any]) -> DecodeConfig:
    """The DecodeConfig for the model (its ModelConfig: the loaded model's, or its config.json's before any weight
    is read): what the model fixes of the canvas and was not given (`decode.model_canvas`: a block-diffusion
    model's blocks of its block_size; a uniform-noise canvas model's canvases of its canvas_length, gen_length
    rounded up to whole canvases), and, without a `strategy`, a rule the model can run (`default_strategy`);
    checked with everything else that depends on the model (a bidirectional model keeps the default
    block_length and has its canvas checked here)."""
    fixed = {k: v for k, v in model_canvas(config, cfg.gen_length).items() if k not in given}
    if "strategy" not in given:
        fixed["strategy"] = default_strategy(cfg, config, given)
    cfg = dataclasses.replace(cfg, **fixed) if fixed else cfg
    try:
        return cfg.validate(config)
    except DecodeError as e:
        raise ModelArgsError(f"model_args: {e}") from None


def default_strategy(cfg: DecodeConfig, config, given: dict[str, Any]):
    """The rule of model arguments that name no strategy: DecodeConfig's default (localleap), unless the model
    cannot run it (a uniform-noise canvas model runs canvas rules only: DiffusionGemma), then its family's first
    evaluation strategy (`Family.eval_strategies`: entropy_bound), with the shared settings given applied."""
    if cfg.traits.canvas == bool(config.canvas_length):
        return cfg.strategy
    spec = split_specs(family_of(config).eval_strategies)[0]
    shared = {k: _SHARED_PARSERS[k](given[k]) for k in SHARED_SETTINGS if k in given}
    try:
        return with_shared_settings(spec, **shared)
    except DecodeError as e:
        raise ModelArgsError(f"model_args (strategy {spec}, {config.family}'s default): {e}") from None
