"""Decoding dynamics, the paper's Figures 1 and 2: python experiments/analyze_dynamics.py --output DIR

The command line of `localleap_jax.commands.analyze_dynamics` (its --help and docstring say the rest)."""

import sys

from localleap_jax import cli

if __name__ == "__main__":
    cli.guard_startup()  # a Ctrl-C while the imports below load: one line, exit 130
    from localleap_jax.commands.analyze_dynamics import main

    sys.exit(main())
