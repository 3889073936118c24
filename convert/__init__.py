"""Checkpoint converters, thin command lines over `localleap_jax.convert_hf`:

    python -m convert SRC OUT           # the family (LLaDA, Dream or SDAR) read from SRC's config.json
    python -m convert.llada SRC OUT     # refuses a Dream source, naming it
    python -m convert.dream SRC OUT     # refuses a LLaDA source, naming it
    python -m convert.sdar SRC OUT      # SDAR / TraDo block-diffusion models

Every mistake ends with exit status 2 and one line `error: ...`; Ctrl-C, SIGTERM or SIGHUP with status 130
and one line, leaving no output directory.
"""

import os
import signal
import sys


def _interrupted_while_starting(signum, frame):
    # Ctrl-C while the heavy imports below run: nothing exists yet, so say so instead of a traceback.
    # os._exit, not SystemExit: unwinding out of a half-imported C extension can crash the interpreter.
    print("error: interrupted before anything was written", file=sys.stderr, flush=True)
    os._exit(130)


# Only for `python -m convert...` (Python sets argv[0] to "-m" while it locates the module), never
# for a program that merely imports this package.
if sys.argv[:1] == ["-m"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    for _name in ("SIGTERM", "SIGHUP"):  # a scheduler's kill, a closed terminal: the same, in one line
        if hasattr(signal, _name) and signal.getsignal(getattr(signal, _name)) is signal.SIG_DFL:
            signal.signal(getattr(signal, _name), _interrupted_while_starting)

import argparse  # noqa: E402

from localleap_jax.checkpoint import CheckpointError  # noqa: E402
from localleap_jax.convert_hf import ConversionError, convert  # noqa: E402
from localleap_jax.families import FAMILIES  # noqa: E402


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `error:` line (no usage block)."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _terminated(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv=None, family: str | None = None) -> int:
    """The command line; exit status 2 and one `error:` line for anything wrong with the input."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on, Ctrl-C cleans up as it unwinds
    terminating = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    previous = {sig: signal.signal(sig, _terminated) for sig in terminating}  # and SIGTERM / SIGHUP the same way
    try:
        return _main(argv, family)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _main(argv, family: str | None) -> int:
    prog = "python -m convert" + (f".{family}" if family else "")
    what = (f"a Hugging Face {FAMILIES[family].title} checkpoint" if family else
            f"a Hugging Face {', '.join(f.title for f in FAMILIES.values())} checkpoint")
    ap = _OneLineParser(prog=prog, description=f"Convert {what} (safetensors) into a localleap-jax checkpoint "
                        "directory. Remote code is never run; pickle checkpoints are refused.")
    ap.add_argument("src", help="local HF checkpoint directory or hub id")
    ap.add_argument("out", help="output checkpoint directory (must not exist or be empty)")
    ap.add_argument("--dtype", default="source", choices=("source", "bfloat16", "float16", "float32"),
                    help="parameter dtype to store (default: the source's, bf16 for LLaDA and Dream)")
    ap.add_argument("--revision", help="hub revision (branch, tag or commit)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        out = convert(args.src, args.out, args.dtype, args.revision, progress=not args.quiet, family=family)
    except (ConversionError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        what = f" ({e})" if str(e) else ""  # SIGTERM / SIGHUP by name; Ctrl-C as before
        print(f"error: interrupted{what}; nothing was written to {args.out}", file=sys.stderr)
        return 130
    print(f"wrote {out}")
    return 0
