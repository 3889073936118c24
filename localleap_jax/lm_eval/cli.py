"""The command line: `lm_eval` with the `localleap` model registered, taking exactly lm_eval's arguments,
and ending a mistake with one `error: ...` line (status 2). What can be checked in a second (the model
arguments, the stats path, the checkpoint's files and length) is checked before lm-eval indexes its tasks."""

from __future__ import annotations

import sys
from pathlib import Path

from localleap_jax import processes
from localleap_jax.checkpoint import CheckpointError, read_manifest
from localleap_jax.errors import ConfigError
from localleap_jax.resolve import is_hub_id, resolve_checkpoint
from localleap_jax.decode import DecodeConfig, DecodeError
from localleap_jax.dist.multihost import leading
from localleap_jax.lm_eval.args import ModelArgsError, check_gen_length, parse_model_args, refuse_python_only
from localleap_jax.lm_eval.devices import follow, join_and_mesh, processes_of
from localleap_jax.lm_eval.identity import CacheMismatchError
from localleap_jax.lm_eval.prompts import PromptTooLongError
from localleap_jax.lm_eval.stats import check_writable
from localleap_jax.likelihood import LikelihoodError
from localleap_jax.tokenizer import TokenizerError
from localleap_jax.families import read_config_file

# Mistakes the command line reports in one line (exit status 2).
USER_ERRORS = (LikelihoodError, ModelArgsError, PromptTooLongError, CacheMismatchError, CheckpointError,
               processes.DistributedError,
               ConfigError, DecodeError, TokenizerError)


def check_checkpoint(settings: dict, cfg: DecodeConfig) -> None:
    """For a checkpoint on disk: it is complete and its length admits gen_length (reads two small files).
    A hub id is left to `load`, which converts it."""
    name = settings["checkpoint"]
    if is_hub_id(name):  # resolving it here would start a conversion
        return
    path = resolve_checkpoint(name)
    read_manifest(path)
    try:
        config = read_config_file(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    check_gen_length(cfg, config.max_sequence_length)


def preflight(given: dict) -> None:
    """What the command line checks in a second, before lm-eval spends its time indexing tasks."""
    refuse_python_only(given)
    settings, cfg = parse_model_args(given)
    if settings["stats_path"]:
        check_writable(Path(settings["stats_path"]))
    check_checkpoint(settings, cfg)


# What the hub libraries raise when a task's data cannot be fetched (offline, unreachable, no such dataset).
_UNREACHABLE = ("ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError",
                "MaxRetryError", "NameResolutionError", "ConnectTimeout")


def unreachable_data(error: BaseException) -> BaseException | None:
    """The exception in `error`'s chain that says a download failed, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ in _UNREACHABLE:
            return error
        error = error.__cause__ or error.__context__
    return None


def offline_message(error: BaseException, tasks) -> str:
    from localleap_jax.errors import first_line

    tasks = ",".join(map(str, tasks)) if isinstance(tasks, (list, tuple)) else tasks
    return (f"lm-eval could not download the data of --tasks {tasks} ({type(error).__name__}: {first_line(error)}): "
            "offline or the hub is unreachable. GSM8K from local files works offline: python -m "
            "localleap_jax.lm_eval.local_task OUT [--data FILE.jsonl], then --include_path OUT/tasks --tasks gsm8k_local")


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
            processes.initialize(processes_of(settings))  # before anything touches a JAX backend
            if processes.is_follower():  # no lm-eval here: carry out process 0's generations
                return follow(settings["compile_cache"])
            join_and_mesh(settings)  # a mesh the devices cannot hold is refused now, not after lm-eval's indexing
        with leading():  # the followers are released however this ends
            cli.execute(args)
    except processes.LostProcessError as e:
        processes.exit_lost(str(e))
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a task whose data lm-eval cannot fetch: one line saying what to do instead
        cause = unreachable_data(e)
        if cause is None:
            raise
        print(f"error: {offline_message(cause, getattr(args, 'tasks', '?'))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        cache = getattr(args, "use_cache", None)
        kept = (f"answers finished so far are kept in the response cache {cache}*; rerun the same command to resume"
                if cache else "nothing was kept (pass --use_cache PATH to make a run resumable)")
        print(f"interrupted: {kept}", file=sys.stderr)
        return 130
    return 0
