"""The command line: `lm_eval` with the `localleap` model registered, taking exactly lm_eval's arguments,
and ending as every command does (`localleap_jax.cli`): a mistake in one `error: ...` line (status 2), Ctrl-C,
SIGTERM or SIGHUP in one line saying what was kept (status 130). What can be checked in a second (the model
arguments, the stats path, the checkpoint's files and length) is checked before lm-eval indexes its tasks."""

from __future__ import annotations

import sys
from pathlib import Path

from localleap_jax import cli, processes
from localleap_jax.checkpoint import CheckpointError, read_manifest
from localleap_jax.errors import ConfigError
from localleap_jax.resolve import is_hub_id, resolve_checkpoint
from localleap_jax.decode import DecodeConfig, DecodeError
from localleap_jax.dist.multihost import leading
from localleap_jax.errors import LocalLeapError, UserError
from localleap_jax.lm_eval.args import (ModelArgsError, check_gen_length, fit_to_model, parse_model_args,
                                       refuse_python_only, with_checkpoint_defaults)
from localleap_jax.lm_eval.devices import follow, join_and_mesh, processes_of
from localleap_jax.lm_eval.identity import CacheMismatchError, check_response_cache, response_cache_file
from localleap_jax.lm_eval.prompts import PromptTooLongError
from localleap_jax.lm_eval.stats import check_writable
from localleap_jax.likelihood import LikelihoodError
from localleap_jax.tokenizer import TokenizerError
from localleap_jax.families import read_config_file

# Mistakes the command line reports in one line (exit status 2).
USER_ERRORS = (LikelihoodError, ModelArgsError, PromptTooLongError, CacheMismatchError, CheckpointError,
               processes.DistributedError,
               ConfigError, DecodeError, TokenizerError)


def check_checkpoint(settings: dict, cfg: DecodeConfig, given: dict | None = None) -> None:
    """For a checkpoint on disk: it is complete, the decoding settings fit its model (`fit_to_model` with the
    model arguments `given`: a masked rule on a canvas model, a block_length other than its own, ...) and its
    length admits gen_length (reads two small files, no weights). A hub id is left to `load`, which converts it."""
    name = settings["checkpoint"]
    if is_hub_id(name):  # resolving it here would start a conversion
        return
    path = resolve_checkpoint(name)
    read_manifest(path)
    try:
        config = read_config_file(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if given is not None:
        cfg = fit_to_model(with_checkpoint_defaults(cfg, path, given), config, given)
    check_gen_length(cfg, config.max_sequence_length)


def preflight(given: dict) -> None:
    """What the command line checks in a second, before lm-eval spends its time indexing tasks."""
    refuse_python_only(given)
    settings, cfg = parse_model_args(given)
    if settings["stats_path"]:
        check_writable(Path(settings["stats_path"]))
    check_checkpoint(settings, cfg, given)


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
    harness = HarnessCLI()
    args = harness.parse_args()
    settings: dict = {}
    if getattr(args, "model", None) == "localleap":
        status = cli.run_command(lambda: settings.update(prepare(args)), lambda why: interrupted(args, why))
        if status:
            return status
        if processes.is_follower():  # no lm-eval here: carry out process 0's generations (signals: its own)
            return follow(settings["compile_cache"])
    try:
        return cli.run_command(lambda: evaluate(harness, args, settings), lambda why: interrupted(args, why))
    except processes.LostProcessError as e:
        processes.exit_lost(str(e))


def prepare(args) -> dict:
    """The localleap model's arguments checked and the processes joined, before lm-eval starts; its settings."""
    given = _cli_model_args(args)
    preflight(given)
    settings, _ = parse_model_args(given)
    processes.initialize(processes_of(settings))  # before anything touches a JAX backend
    return settings


def check_outputs(args) -> None:
    """What lm-eval will write, tried before it starts: --output_path (a directory, or a .json file's directory;
    lm-eval writes it at the very end and only warns when it cannot) and --use_cache (PATH_rank<N>.db)."""
    if getattr(args, "output_path", None):
        path = Path(args.output_path)
        cli.check_writable_dir(path.parent if path.suffix == ".json" else path, "--output_path", path)
    if getattr(args, "use_cache", None):
        cli.check_writable_dir(Path(args.use_cache).expanduser().resolve().parent, "--use_cache", args.use_cache)


def evaluate(harness, args, settings: dict) -> int:
    """lm-eval's run, on process 0 (or the only process); a task lm-eval does not know, or whose data cannot be
    fetched: one line."""
    check_outputs(args)
    if getattr(args, "use_cache", None):  # a damaged file: one line naming it, before lm-eval's writer thread fails
        check_response_cache(response_cache_file(args.use_cache))
    try:
        if settings:
            join_and_mesh(settings)  # a mesh the devices cannot hold is refused now, not after lm-eval's indexing
        with leading():  # the followers are released however this ends
            harness.execute(args)
    except LocalLeapError:
        raise
    except ValueError as e:  # lm-eval's "Tasks not found: a, b"
        if not str(e).startswith(TASKS_NOT_FOUND):
            raise
        missing = str(e)[len(TASKS_NOT_FOUND):].strip()
        raise UserError(f"lm-eval knows no task {missing}: `python -m localleap_jax.lm_eval ls tasks` lists them, "
                        "and --include_path DIR adds tasks of your own (YAML files)") from None
    except Exception as e:  # a task whose data lm-eval cannot fetch: one line saying what to do instead
        cause = unreachable_data(e)
        if cause is None:
            raise
        raise UserError(offline_message(cause, getattr(args, "tasks", "?"))) from None
    return 0


TASKS_NOT_FOUND = "Tasks not found:"  # lm-eval's message for --tasks it cannot match


def interrupted(args, why: str) -> str:
    cache = getattr(args, "use_cache", None)
    kept = (f"the answers and scores finished so far are kept in the response cache "
            f"{response_cache_file(Path(cache).expanduser().resolve())}; rerun the same command to resume" if cache else
            "nothing was kept (pass --use_cache PATH to make a run resumable)")
    return f"interrupted ({why}): {kept}"
