"""lm-eval-harness model `localleap`: lm-eval owns tasks, prompts, filters and metrics; this only generates.

    python -m localleap_jax.lm_eval_adapter --model localleap \\
        --model_args checkpoint=DIR,strategy=localleap,gen_length=256,block_length=32 --tasks gsm8k

(`python -m localleap_jax.lm_eval_adapter` is the `lm_eval` command with this model registered;
it takes exactly lm_eval's arguments, and ends a mistake with one `error: ...` line.)

`generate_until`: each request's context (the whole few-shot string) becomes one user turn of the
chat template, as the LLaDA/Fast-dLLM/LocalLeap evaluations did; requests are sorted by length
and batched with left padding (prompt lengths are bucketed by `generate`, so a task compiles a
handful of programs); every batch runs across all local devices (pmap); the output is cut at the
request's `until` strings. After every batch the per-request NFE/seconds go to `stats_path` and
then the answers to lm-eval's cache hook (so `--use_cache` resumes an interrupted run, and an
answer is never cached without its stats).

A prompt longer than the model leaves room for (max_sequence_length - gen_length) is refused
before anything is generated; with `truncate_fewshot=True` whole few-shot examples are dropped
from its front instead (never the chat template's tokens or the question), counted per request
in the stats as `fewshot_dropped`.

A response cache is claimed by the setup that wrote it (`answers_key`: weights, tokenizer, every
decoding setting that changes tokens), so answers of another model or setting are never reused.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from localleap_jax.checkpoint import CheckpointError, Model, params_fingerprint, read_manifest, resolve_checkpoint
from localleap_jax.config import ConfigError
from localleap_jax.decode import DecodeConfig, DecodeError
from localleap_jax.rules import RULES
from localleap_jax.rules.base import make_spec, settings_of
from localleap_jax.rules.registry import parse_spec, parse_value
from localleap_jax import multihost
from localleap_jax.parallel import generate_parallel
from localleap_jax.tokenizer import BOS_TOKEN, TOKENIZER_FILES, TokenizerError, cut_at_stop, left_pad


class GenerationOnlyError(NotImplementedError):
    """A task asked for log-likelihoods, which a diffusion decoder does not provide."""


class ModelArgsError(ValueError):
    """Model arguments (`--model_args` or LocalLeapLM keywords) that name no setting or hold a bad value."""


class PromptTooLongError(ValueError):
    """Prompts that do not fit beside the generation canvas; refused before anything is generated."""

    def __init__(self, too_long: int, total: int, excess: int, room: int, max_sequence_length: int,
                 gen_length: int, truncating: bool):
        self.truncating = truncating  # few-shot examples were already dropped where they could be
        self.summary = (f"{too_long} of {total} prompts are longer than the {room} tokens the model leaves for a "
                        f"prompt (max_sequence_length {max_sequence_length} - gen_length {gen_length}), by up to "
                        f"{excess} tokens")
        super().__init__(f"{self.summary}; " + (
            "truncate_fewshot could not make them fit (the question alone is too long, or lm-eval chat-formatted "
            "the prompt, which leaves no few-shot text to cut): lower gen_length" if truncating else
            "pass truncate_fewshot=True in --model_args to drop few-shot examples, or lower --num_fewshot or "
            "gen_length"))


class CacheMismatchError(ValueError):
    """A response cache written by another model or decoding setup."""


# Mistakes the command line reports in one line (exit status 2).
USER_ERRORS = (GenerationOnlyError, ModelArgsError, PromptTooLongError, CacheMismatchError, CheckpointError,
               multihost.DistributedError,
               ConfigError, DecodeError, TokenizerError)


def prompt_key(context: str) -> str:
    return hashlib.sha256(context.encode()).hexdigest()


def cut_at_until(text: str, until: list[str] | str | None) -> str:
    """The text up to the earliest of the stop strings."""
    if isinstance(until, str):
        until = [until]
    for stop in until or ():
        if stop:
            text = text.split(stop, 1)[0]
    return text


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def generation_only_message(tasks) -> str:
    return (f"localleap generates only: task(s) {', '.join(sorted(tasks))} ask for log-likelihoods, which a diffusion "
            "decoder does not provide; use generation tasks such as gsm8k, minerva_math, humaneval, mbpp")


# ---------------------------------------------------------------- model arguments

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
    if value not in ("auto", "bfloat16", "float16", "float32"):
        raise ValueError(f"expected auto, bfloat16, float16 or float32, got {value!r}")
    return value


def _ignored(value):
    return value


def _as_mesh(value):
    """'data=2;model=4' (';' between the axes: lm-eval splits model_args at commas) or a Mesh object."""
    from jax.sharding import Mesh

    from localleap_jax.sharding import parse_mesh

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
    "checkpoint": (_as_optional(_as_str), None),
    "batch_size": (_as_batch_size, 8),
    "dtype": (_as_dtype, "auto"),
    "chat": (_as_bool, True),
    "compile_cache": (_as_bool, True),
    "stats_path": (_as_optional(_as_str), None),
    "seed": (functools.partial(_as_int, low=0, high=2**32 - 1), 0),
    "progress": (_as_bool, True),
    "truncate_fewshot": (_as_bool, False),
    "fewshot_delimiter": (_as_str, "\n\n"),  # lm-eval's default separator between few-shot examples
    # Devices and processes: every process runs the same command; process 0 runs lm-eval, the others follow.
    "mesh": (_as_mesh, None),
    "coordinator": (_as_optional(_as_str), None),
    "num_processes": (_as_optional(functools.partial(_as_int, low=1)), None),
    "process_id": (_as_optional(functools.partial(_as_int, low=0)), None),
    "max_batch_size": (_ignored, None),  # lm-eval passes these to every model; nothing here uses them
    "device": (_ignored, None),
}
# Python objects, for callers that build the LM themselves; never from a command line.
PYTHON_ONLY_ARGS = ("model", "on_batch", "answers_key")

_DECODE_PARSERS = {"int": functools.partial(_as_int, low=None), "float": _as_float, "bool": _as_bool, "str": _as_str,
                   "int | None": _as_optional(_as_int), "float | None": _as_optional(_as_float)}


def _rule_settings(strategy) -> set[str]:
    """The settings the named rule takes (so `tau_kl=0.05` may follow `strategy=klass` in model_args:
    lm-eval splits model_args at commas, so a spec's second setting arrives as a key of its own)."""
    if not isinstance(strategy, str):
        return set()
    cls = RULES.get(parse_spec(strategy)[0]) if ":" in strategy or strategy in RULES else None
    return set(settings_of(cls())) if dataclasses.is_dataclass(cls) else set()


def _decode_parser(field: dataclasses.Field) -> Callable:
    # Field annotations are strings (postponed annotations); an unfamiliar one passes the value through
    # and DecodeConfig judges it.
    return _DECODE_PARSERS.get(str(field.type), _ignored)


def parse_model_args(given: dict[str, Any]) -> tuple[dict[str, Any], DecodeConfig]:
    """(adapter settings with defaults filled in, validated DecodeConfig) from model arguments.

    Every unknown name and every badly typed value is reported in one ModelArgsError, so a command
    line is fixed in one go; nothing is loaded here, so the command line can check it first."""
    decode_fields = {f.name: f for f in dataclasses.fields(DecodeConfig)}
    try:
        rule_keys = _rule_settings(given.get("strategy", DecodeConfig.strategy)) - set(decode_fields)
    except DecodeError as e:
        raise ModelArgsError(f"model_args strategy: {e}") from None
    known = sorted(set(ADAPTER_ARGS) | set(decode_fields) | rule_keys)
    problems, settings, decode, rule_extra = [], {}, {}, {}
    unknown = [name for name in given if name not in known]
    for name in unknown:
        near = difflib.get_close_matches(name, known, n=1)
        problems.append(f"unknown model_args key {name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    for name, value in given.items():
        if name in ADAPTER_ARGS:
            parse, target = ADAPTER_ARGS[name][0], settings
        elif name in decode_fields:
            parse, target = _decode_parser(decode_fields[name]), decode
        elif name in rule_keys:
            parse, target = (lambda v: parse_value(v) if isinstance(v, str) else v), rule_extra
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
    if rule_extra:  # fold the rule's own settings into its spec: "klass:tau_c=0.5" + tau_kl=0.05
        name, spec_settings = parse_spec(decode.get("strategy", DecodeConfig.strategy))
        decode["strategy"] = make_spec(name, {**spec_settings, **rule_extra})
    try:
        cfg = DecodeConfig(**decode).validate()
    except DecodeError as e:
        raise ModelArgsError(f"model_args: {e}") from None
    return settings, cfg


def check_gen_length(model: Model, cfg: DecodeConfig) -> None:
    limit = model.config.max_sequence_length
    if cfg.gen_length >= limit:
        raise ModelArgsError(f"gen_length={cfg.gen_length} leaves no room for a prompt: the model's "
                             f"max_sequence_length is {limit}")


# ---------------------------------------------------------------- what the answers depend on

ENCODING_FILES = tuple(f for f in TOKENIZER_FILES if f != "generation_config.json")  # what decides token ids
CACHE_OWNER = "localleap_jax/answers_key"  # the entry of a response cache naming the setup that wrote it


def decode_settings(cfg: DecodeConfig) -> dict:
    """What in the DecodeConfig changes tokens: its fields and the rule's every setting (not prompt_bucket:
    left padding, which attention masks out)."""
    return cfg.fingerprint()


def rows_interact(cfg: DecodeConfig) -> bool:
    """Whether a row's tokens depend on which rows share its batch: sampling draws one key per batch.
    (With a KV cache the rows advance through blocks together, but a row only waits, with its own
    canvas and cache unchanged, so its tokens do not depend on the others: tests/test_decode.py.)"""
    return cfg.temperature > 0


def _sha256_files(paths) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(f"{path.name}\n".encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _checkpoint_fingerprint(path: str, manifest_stamp: tuple) -> str:
    return params_fingerprint(path)


def weights_fingerprint(model: Model) -> str:
    """Content identity of the weights: the checkpoint's params_fingerprint (recorded at conversion,
    else hashed from its files once per process), or a hash of the arrays of a model built in memory."""
    if model.path is not None:
        path = Path(model.path).resolve()
        st = os.stat(path / "manifest.json")  # a replaced checkpoint has a new manifest: never a stale memo
        return _checkpoint_fingerprint(str(path), (st.st_ino, st.st_mtime_ns, st.st_size))
    h = hashlib.sha256()
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        leaf = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(keypath)}{leaf.dtype}{leaf.shape}".encode())
        h.update(leaf.tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(model: Model) -> str:
    """Hash of the files that decide token ids (the tokenizer, its config and chat template)."""
    if model.path is not None:
        files = [Path(model.path) / name for name in ENCODING_FILES if (Path(model.path) / name).is_file()]
        if files:
            return _sha256_files(files)
    hf = model.tokenizer.hf
    return hashlib.sha256(json.dumps([hf.backend_tokenizer.to_str(), hf.chat_template,
                                      hf.special_tokens_map], sort_keys=True, default=str).encode()).hexdigest()


def answers_key(model: Model, cfg: DecodeConfig, *, chat: bool, seed: int, truncate_fewshot: bool | str,
                batch: dict, task: dict | None = None) -> dict:
    """Everything the generated answers depend on, as a JSON-able dict; its digest names a resume cache.

    `batch`: what decides which requests share a batch (batch size, device count, the requests run),
    counted only when rows of a batch change each other's tokens. `task`: what the caller knows of the
    prompts (the data, the number of few-shot examples). Nothing else belongs here: not where the
    checkpoint or the output lives, not settings that only change speed."""
    key = {
        "weights": weights_fingerprint(model),
        "model_config": dataclasses.asdict(model.config),
        "tokenizer": tokenizer_fingerprint(model),
        "dtype": str(model.dtype),
        "decode": decode_settings(cfg),
        "chat": bool(chat),
        "truncate_fewshot": truncate_fewshot,
    }
    if cfg.temperature > 0:  # greedy decoding draws no random numbers
        key["seed"] = seed
    if rows_interact(cfg):
        key["batch"] = batch
    if task:
        key["task"] = task
    return key


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _differences(found: Any, wanted: Any, where: str = "") -> list[str]:
    if isinstance(found, dict) and isinstance(wanted, dict):
        return [d for k in sorted(set(found) | set(wanted), key=str)
                for d in _differences(found.get(k), wanted.get(k), f"{where}.{k}" if where else str(k))]
    return [] if found == wanted else [where or "key"]


def claim_cache(db, key: dict) -> None:
    """Mark an lm-eval response cache as this setup's, or refuse one another setup wrote."""
    found = db.get(CACHE_OWNER)
    if found is None and len(db):  # written before caches were claimed: whose answers they are is unknown
        raise CacheMismatchError(f"the response cache {getattr(db, 'filename', '')} holds answers with no record of "
                                 "the model and settings that wrote them; delete it or use another --use_cache path")
    if found is None:
        db[CACHE_OWNER] = key
        db.commit()
    elif found != key:
        raise CacheMismatchError(f"the response cache {getattr(db, 'filename', '')} holds answers of another setup "
                                 f"({', '.join(_differences(found, key))} differ); use another --use_cache path")


def forget_missing_answers(db) -> int:
    """Delete cache entries that hold no answer (an old failure stored None), so they are generated again."""
    empty = [k for k, v in db.items() if v is None]
    for k in empty:
        del db[k]
    if empty:
        db.commit()
    return len(empty)


# ---------------------------------------------------------------- prompts


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]  # the chat-formatted prompt that is generated from
    fewshot_dropped: int  # few-shot examples removed to make it fit


def fewshot_spans(context: str, doc: dict, delimiter: str) -> tuple[list[int], int] | None:
    """(where each few-shot example starts, where the question starts) in an lm-eval context, or None.

    lm-eval builds a context as [description] example_1 + delimiter + ... + example_k + delimiter +
    question, every example rendered by the question's template. The question is found through the
    document it was rendered from (the last occurrence of its longest text field in the context); it
    starts after the last delimiter before that, and the text between is the template's prefix
    (gsm8k: "Question: "). An example starts after a delimiter followed by that prefix, so a delimiter
    inside an example (a few GSM8K questions hold blank lines) does not split it."""
    fields = sorted((v for v in (doc or {}).values() if isinstance(v, str) and v.strip() and v in context),
                    key=len, reverse=True)
    if not fields or not delimiter:
        return None
    anchor = context.rfind(fields[0])
    cut = context.rfind(delimiter, 0, anchor)
    if cut < 0:
        return None  # no few-shot examples
    question = cut + len(delimiter)
    prefix = context[question:anchor]
    starts = [0] if context.startswith(prefix) else []
    at = context.find(delimiter)
    while 0 <= at < cut:
        after = at + len(delimiter)
        if context.startswith(prefix, after) and after not in starts:
            starts.append(after)
        at = context.find(delimiter, after)
    return (starts, question) if starts else None


# ---------------------------------------------------------------- stats log


def read_stats(path: Path) -> dict[str, dict]:
    """Per-request stats from the appended JSONL log, by prompt key.

    A record counts once its newline is written: a torn last record (the process was killed or the
    disk filled mid-write) is cut from the file, so the next append starts on a fresh line, and its
    request, never cached before its stats (see generate_until), is generated again. An unreadable
    complete line is skipped the same way."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
        print(f"note: {path}: dropped a torn last record; its request is generated again", file=sys.stderr)
    stats = {}
    for line in complete.splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(row, dict) and isinstance(row.get("key"), str):
            stats[row["key"]] = row
    return stats


def check_writable(path: Path) -> None:
    """Refuse a stats_path that cannot be appended to, leaving nothing behind (a refused run creates nothing)."""
    path = Path(path)
    created = next((p for p in (*reversed(path.parent.parents), path.parent) if not p.exists()), None)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        open(path, "a").close()
    except OSError as e:
        raise ModelArgsError(f"model_args stats_path: cannot write {path} ({e.strerror})") from None
    finally:
        if not existed and path.is_file():
            path.unlink()
        if created is not None and created.exists():
            shutil.rmtree(created, ignore_errors=True)


def check_checkpoint(settings: dict, cfg: DecodeConfig) -> None:
    """For a checkpoint on disk: it is complete and its length admits gen_length (reads two small files).
    A hub id is left to `load`, which converts it."""
    from localleap_jax.config import ModelConfig

    name = settings["checkpoint"]
    # resolve_checkpoint's own test for "not a hub id" (a hub id would start a conversion here)
    if name not in (None, "", "embedded") and not Path(name).expanduser().exists() and \
            str(name).count("/") == 1 and not str(name).startswith((".", "/", "~")):
        return
    path = resolve_checkpoint(name)
    read_manifest(path)
    try:
        config = ModelConfig.from_json_file(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if cfg.gen_length >= config.max_sequence_length:
        raise ModelArgsError(f"gen_length={cfg.gen_length} leaves no room for a prompt: the model's "
                             f"max_sequence_length is {config.max_sequence_length}")


def preflight(given: dict) -> None:
    """What the command line checks in a second, before lm-eval spends its time indexing tasks."""
    python_only = sorted(set(given) & set(PYTHON_ONLY_ARGS))
    if python_only:
        raise ModelArgsError(f"model_args {', '.join(python_only)} cannot be given on the command line")
    settings, cfg = parse_model_args(given)
    if settings["stats_path"]:
        check_writable(Path(settings["stats_path"]))
    check_checkpoint(settings, cfg)


def follow(compile_cache: bool) -> int:
    """A follower's whole evaluation: carry out process 0's generations until it stops (no lm-eval, no
    files). With `compile_cache` it reads the programs process 0 compiled before, where there are any
    (JAX writes entries only from process 0, and a follower creates no directory)."""
    from localleap_jax.compile_cache import DEFAULT_DIR, enable_compilation_cache

    if compile_cache and DEFAULT_DIR.is_dir():
        enable_compilation_cache()
    return multihost.follow_until_stopped("evaluation")


def processes_of(settings: dict) -> multihost.Processes:
    try:
        return multihost.processes_from(settings["coordinator"], settings["num_processes"], settings["process_id"],
                                        flags={k: f"model_args {k}" for k in multihost.FLAGS})
    except multihost.DistributedError as e:
        raise ModelArgsError(str(e)) from None


def join_and_mesh(settings: dict):
    """Join the other processes if model_args say so and nobody has yet, then the mesh to generate on:
    model_args mesh over every device, model=1 for several processes without one, else None (pmap)."""
    import jax

    processes = processes_of(settings)
    if processes.joins and not jax.distributed.is_initialized():
        multihost.initialize(processes)
    if isinstance(settings["mesh"], jax.sharding.Mesh):
        return settings["mesh"]
    try:
        return multihost.mesh_for_run(settings["mesh"])
    except DecodeError as e:
        raise ModelArgsError(f"model_args {e}") from None


# ---------------------------------------------------------------- the model


@register_model("localleap")
class LocalLeapLM(LM):
    """A LLaDA-architecture checkpoint decoded by `localleap_jax.generate`.

    Model arguments: those in ADAPTER_ARGS and every DecodeConfig field. `model` (a loaded Model),
    `on_batch` (called after each batch) and `answers_key` (a caller's resume key, see `answers_key`)
    are for Python callers."""

    def __init__(self, model: Model | None = None, on_batch: Callable | None = None,
                 answers_key: dict | None = None, **model_args: Any):
        super().__init__()
        settings, self.cfg = parse_model_args(model_args)
        if settings["compile_cache"]:
            from localleap_jax.compile_cache import enable_compilation_cache
            enable_compilation_cache()
        self.batch_size = settings["batch_size"]
        self.chat = settings["chat"]
        self.seed = settings["seed"]
        self.progress = settings["progress"]
        self.truncate_fewshot = settings["truncate_fewshot"]
        self.fewshot_delimiter = settings["fewshot_delimiter"]
        self.stats_path = Path(settings["stats_path"]) if settings["stats_path"] else None
        self.stats = self._open_stats()
        self.mesh = join_and_mesh(settings)
        if model is None:
            dtype = settings["dtype"]
            model = multihost.leader().load(resolve_checkpoint(settings["checkpoint"]),
                                            dtype=default_dtype() if dtype == "auto" else dtype, mesh=self.mesh)
        check_gen_length(model, self.cfg)
        self.model = model
        self.rng = jax.random.key(self.seed)
        self.on_batch = on_batch
        self._answers_key = answers_key
        self.model_calls = 0  # batches generated by this instance (0 when everything came from the cache)
        self.rows_generated = 0  # requests answered by this instance
        self._totals = [0, 0, 0, 0.0]  # rows, NFE, tokens, seconds generated (for the progress bar)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LocalLeapLM:
        # lm-eval passes its --batch_size/--device beside --model_args; a key in both is taken from
        # --model_args (lm-eval itself would fail on the duplicate keyword).
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        given = {**extra, **arg_dict}
        from_python = sorted(set(given) & set(PYTHON_ONLY_ARGS))
        if from_python:
            raise ModelArgsError(f"model_args {', '.join(from_python)} cannot be given on the command line")
        return cls(**given)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LocalLeapLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def answers_key(self) -> dict:
        """What this instance's answers depend on (computed on first use: it hashes the weights' identity)."""
        if self._answers_key is None:
            batch = {"batch_size": self.batch_size, "devices": jax.local_device_count(),
                     "mesh": None if self.mesh is None else dict(self.mesh.shape)}
            delimiter = self.fewshot_delimiter if self.truncate_fewshot else False
            self._answers_key = answers_key(self.model, self.cfg, chat=self.chat, seed=self.seed,
                                            truncate_fewshot=delimiter, batch=batch)
        return self._answers_key

    # ---------------------------------------------------------------- lm-eval API

    @property
    def tokenizer_name(self) -> str:
        return str(self.model.path or "localleap").replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.model.tokenizer.hf.apply_chat_template(chat_history, tokenize=False,
                                                           add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.model.tokenizer.hf.chat_template

    def set_cache_hook(self, cache_hook) -> None:
        """lm-eval hands over its response cache here, before any request: claim it for this setup and
        drop entries that hold no answer, so they are generated again instead of failing the run."""
        super().set_cache_hook(cache_hook)
        db = getattr(cache_hook, "dbdict", None)
        if db is None:
            return
        claim_cache(db, self.answers_key)
        dropped = forget_missing_answers(db)
        if dropped:
            print(f"note: {db.filename}: {dropped} cached requests had no answer; generating them again",
                  file=sys.stderr)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise GenerationOnlyError(self._generation_only(requests))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise GenerationOnlyError(self._generation_only(requests))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        prompts = self._fit_prompts(requests)  # refuses over-long prompts before any generation
        order = sorted(range(len(requests)), key=lambda i: (-len(prompts[i].ids), i))
        results: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc=f"generate [{self.cfg.strategy}]", dynamic_ncols=True,
                   disable=disable_tqdm or not self.progress)
        try:  # closed however the loop ends, so an interrupted run's last line is not a stray bar
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                results_of_batch, stats_rows = self._generate_batch(requests, prompts, batch, start)
                self._append_stats(stats_rows)  # stats first: an answer is cached only once its stats are on disk
                for i, text in zip(batch, results_of_batch):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                self.rows_generated += len(batch)
                if self.on_batch is not None:
                    self.on_batch([requests[i] for i in batch], results_of_batch, stats_rows)
                bar.update(len(batch))
                bar.set_postfix(**self._running_totals(), **(getattr(self.on_batch, "postfix", None) or {}))
        finally:
            bar.close()
        unanswered = [i for i, text in enumerate(results) if not isinstance(text, str)]
        if unanswered:  # lm-eval would cache and score the gap as an answer
            raise AssertionError(f"generate_until left {len(unanswered)} of {len(requests)} requests unanswered")
        return results

    # ---------------------------------------------------------------- helpers

    def _generate_batch(self, requests, prompts: list[Prompt], batch: list[int], start: int
                        ) -> tuple[list[str], list[dict]]:
        """Answers (cut at `until`) and stats rows of one batch of requests."""
        tok = self.model.tokenizer
        cfg = self._config_for(requests[batch[0]].args[1])
        # A short last batch is filled up with copies of its last row, so it runs the program the full batches
        # compiled (a second compile costs more than the filler rows: a copy decodes exactly as its original,
        # so the loop takes no extra step); the copies' answers are dropped.
        filled = batch + [batch[-1]] * (self.batch_size - len(batch))
        ids, mask = left_pad([prompts[i].ids for i in filled], tok.pad_id)
        rng = jax.random.fold_in(self.rng, start)
        if self.mesh is None:  # one process: a full copy of the weights on each local device
            out = generate_parallel(self.model, ids, mask, cfg, rng=rng)
        else:  # every process at once, the batch split over "data", the weights over "model"
            out = multihost.leader().generate(self.model, ids, mask, cfg, rng, mesh=self.mesh)
        self.model_calls += 1
        generated = out.tokens[:len(batch), out.prompt_length:]
        texts = tok.decode_generated(generated)
        answers, rows = [], []
        for j, i in enumerate(batch):
            context, gen_kwargs = requests[i].args
            answers.append(cut_at_until(texts[j], gen_kwargs.get("until")))
            row = {"key": prompt_key(context), "nfe": int(out.nfe[j]), "seconds": out.seconds / len(batch),
                   "prompt_tokens": len(prompts[i].ids), "fewshot_dropped": prompts[i].fewshot_dropped,
                   "generated_tokens": len(cut_at_stop(generated[j], tok.stop_ids)),
                   "compile_seconds": out.compile_seconds if j == 0 else 0.0, "batch_size": len(batch)}
            self.stats[row["key"]] = row
            rows.append(row)
        self._totals = [t + v for t, v in zip(self._totals, (len(batch), sum(r["nfe"] for r in rows),
                                                              sum(r["generated_tokens"] for r in rows), out.seconds))]
        return answers, rows

    def _running_totals(self) -> dict:
        rows, nfe, tokens, seconds = self._totals
        return {"nfe": f"{nfe / max(rows, 1):.1f}", "tok_s": f"{tokens / max(seconds, 1e-9):.1f}"}

    def _encode(self, context: str) -> list[int]:
        # A context lm-eval already chat-formatted (--apply_chat_template) starts with BOS: keep it as is.
        chat = self.chat and not context.startswith(BOS_TOKEN)
        return self.model.tokenizer.encode(context, chat=chat)

    def _fit_prompts(self, requests) -> list[Prompt]:
        """Every request's prompt, fitted beside the canvas or refused (all at once, before any work)."""
        room = self.model.config.max_sequence_length - self.cfg.gen_length
        prompts = [self._fit(r, room) for r in requests]
        over = [len(p.ids) - room for p in prompts if len(p.ids) > room]
        if over:
            raise PromptTooLongError(len(over), len(prompts), max(over), room, self.model.config.max_sequence_length,
                                     self.cfg.gen_length, self.truncate_fewshot)
        return prompts

    def _fit(self, request, room: int) -> Prompt:
        """The prompt of one request; with truncate_fewshot, whole few-shot examples are dropped from the
        front until it fits (the chat template is applied afterwards, so its tokens always stay)."""
        context = request.args[0]
        ids = self._encode(context)
        if len(ids) <= room or not self.truncate_fewshot or context.startswith(BOS_TOKEN):
            return Prompt(ids, 0)  # (a context lm-eval chat-formatted has no few-shot text to cut safely)
        spans = fewshot_spans(context, getattr(request, "doc", None) or {}, self.fewshot_delimiter)
        if spans is None:
            return Prompt(ids, 0)
        starts, question = spans
        cuts = starts[1:] + [question]
        for dropped, cut in enumerate(cuts, 1):
            ids = self._encode(context[:starts[0]] + context[cut:])
            if len(ids) <= room:
                break
        return Prompt(ids, dropped)

    def _config_for(self, gen_kwargs: dict) -> DecodeConfig:
        if gen_kwargs.get("do_sample") and float(gen_kwargs.get("temperature") or 0) > 0:
            return dataclasses.replace(self.cfg, temperature=float(gen_kwargs["temperature"]))
        return self.cfg

    def _open_stats(self) -> dict[str, dict]:
        """The stats logged so far; checks now that the log can be written, not after the first batch."""
        if self.stats_path is None:
            return {}
        check_writable(self.stats_path)
        return read_stats(self.stats_path)

    def _append_stats(self, rows: list[dict]) -> None:
        if self.stats_path is None:
            return
        self.stats_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.stats_path, "a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))  # one write: a torn record is the last one

    @staticmethod
    def _generation_only(requests) -> str:
        return generation_only_message({getattr(r, "task_name", None) or "?" for r in requests})


# ---------------------------------------------------------------- command line


@contextmanager
def generation_tasks_only():
    """Refuse log-likelihood tasks before anything is generated: lm-eval runs the request types one
    after the other, so a mixed run would otherwise generate a whole task and only then fail."""
    from lm_eval import evaluator

    original = evaluator.evaluate

    @functools.wraps(original)
    def checked(*args, **kwargs):
        lm = kwargs.get("lm", args[0] if args else None)
        task_dict = kwargs.get("task_dict", args[1] if len(args) > 1 else None)
        tasks = task_dict.get("tasks", {}) if isinstance(task_dict, dict) else {}
        scored = [name for name, task in tasks.items()
                  if getattr(task, "OUTPUT_TYPE", "generate_until") != "generate_until"]
        if scored and isinstance(getattr(lm, "lm", lm), LocalLeapLM):
            raise GenerationOnlyError(generation_only_message(scored))
        return original(*args, **kwargs)

    evaluator.evaluate = checked
    try:
        yield
    finally:
        evaluator.evaluate = original


def _cli_model_args(args) -> dict:
    """The model arguments lm-eval's command line will pass (its --batch_size beside --model_args)."""
    given = dict(getattr(args, "model_args", None) or {})
    if getattr(args, "batch_size", None) is not None:
        given.setdefault("batch_size", args.batch_size)
    return given


def main(argv: list[str] | None = None) -> int:
    """`lm_eval` with the `localleap` model registered; a mistake ends with one `error: ...` line."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()
    cli = HarnessCLI()
    args = cli.parse_args()
    try:
        if getattr(args, "model", None) == "localleap":
            given = _cli_model_args(args)
            preflight(given)
            settings, _ = parse_model_args(given)
            multihost.initialize(processes_of(settings))  # before anything touches a JAX backend
            if multihost.is_follower():  # no lm-eval here: carry out process 0's generations
                return follow(settings["compile_cache"])
        with multihost.leading(), generation_tasks_only():  # the followers are released however this ends
            cli.execute(args)
    except multihost.LostProcessError as e:
        multihost.exit_lost(str(e))
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        cache = getattr(args, "use_cache", None)
        kept = (f"answers finished so far are kept in the response cache {cache}*; rerun the same command to resume"
                if cache else "nothing was kept (pass --use_cache PATH to make a run resumable)")
        print(f"interrupted: {kept}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
