"""Convert a Hugging Face SDAR (or TraDo) block-diffusion checkpoint (safetensors) into a localleap-jax checkpoint directory.

    python -m convert.sdar SRC OUT [--dtype bfloat16|float32|float16|source]

SRC is a local directory or a hub id (e.g. JetAstra/SDAR-4B-Chat). The work is done by
`localleap_jax.convert_hf`; a LLaDA or Dream source is refused in one line (use `python -m convert`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from convert import main as _main
from localleap_jax.convert_hf import ConversionError, convert as _convert

__all__ = ["ConversionError", "convert", "main"]


def convert(src: str, out: str, dtype: str = "source", revision: str | None = None, progress: bool = True) -> Path:
    return _convert(src, out, dtype, revision, progress, family="sdar")


def main(argv=None) -> int:
    return _main(argv, family="sdar")


if __name__ == "__main__":
    sys.exit(main())
