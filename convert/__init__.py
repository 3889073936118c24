"""The checkpoint converter, a thin command line over `localleap_jax.convert_hf`:

    python -m convert SRC OUT                   # the family (LLaDA, Dream or SDAR) read from SRC's config.json
    python -m convert SRC OUT --family dream    # the same, refusing a source of another family in one line

Every mistake ends with exit status 2 and one line `error: ...`; Ctrl-C, SIGTERM or SIGHUP with status 130
and one line, leaving no output directory (`localleap_jax.cli`).
"""

from __future__ import annotations

from localleap_jax import cli  # cheap: `python -m convert` guards its startup before the heavy imports


def main(argv=None) -> int:
    """The command line; exit status 2 and one `error:` line for anything wrong with the input."""
    from localleap_jax.convert_hf import convert
    from localleap_jax.families import FAMILIES

    ap = cli.OneLineParser(prog="python -m convert", description="Convert a Hugging Face "
                           f"{', '.join(f.title for f in FAMILIES.values())} checkpoint (safetensors) into a localleap-jax "
                           "checkpoint directory. Remote code is never run; pickle checkpoints are refused.")
    ap.add_argument("src", help="local HF checkpoint directory or hub id")
    ap.add_argument("out", help="output checkpoint directory (must not exist or be empty)")
    ap.add_argument("--family", choices=tuple(FAMILIES),
                    help="the family SRC must be; a source of another family is refused (default: whichever "
                         "SRC's config.json names)")
    ap.add_argument("--dtype", default="source", choices=("source", "bfloat16", "float16", "float32"),
                    help="parameter dtype to store (default: the source's, bf16 for LLaDA and Dream)")
    ap.add_argument("--revision", help="hub revision (branch, tag or commit)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    def work() -> None:
        cli.check_writable_dir(args.out, "output")  # before reading (or downloading) the source, nothing left behind
        out = convert(args.src, args.out, args.dtype, args.revision, progress=not args.quiet, family=args.family)
        print(f"wrote {out}")

    def interrupted(why: str) -> str:  # Ctrl-C as before; SIGTERM / SIGHUP by name
        named = "" if why == "Ctrl-C" else f" ({why})"
        return f"error: interrupted{named}; nothing was written to {args.out}"

    return cli.run_command(work, interrupted)
