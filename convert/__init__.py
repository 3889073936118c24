"""Checkpoint converters, thin command lines over `localleap_jax.convert_hf`:

    python -m convert SRC OUT           # the family (LLaDA or Dream) read from SRC's config.json
    python -m convert.llada SRC OUT     # refuses a Dream source, naming it
    python -m convert.dream SRC OUT     # refuses a LLaDA source, naming it
"""

from __future__ import annotations

import argparse
import sys

from localleap_jax.checkpoint import CheckpointError
from localleap_jax.convert_hf import FAMILY_NAMES, ConversionError, convert


def main(argv=None, family: str | None = None) -> int:
    """The command line; exit status 2 and one `error:` line for anything wrong with the input."""
    prog = "python -m convert" + (f".{family}" if family else "")
    what = f"a Hugging Face {FAMILY_NAMES[family]} checkpoint" if family else "a Hugging Face LLaDA or Dream checkpoint"
    ap = argparse.ArgumentParser(prog=prog, description=f"Convert {what} (safetensors) into a localleap-jax "
                                 "checkpoint directory. Remote code is never run; pickle checkpoints are refused.")
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
    print(f"wrote {out}")
    return 0
