"""Sweeps of the decoding rules over their settings (Figure 4, the Pareto plot): python experiments/sweep.py --output DIR

The command line of `localleap_jax.commands.sweep` (its --help and docstring say the rest)."""

import sys

from localleap_jax import cli

if __name__ == "__main__":
    cli.guard_startup()  # a Ctrl-C while the imports below load: one line, exit 130
    from localleap_jax.commands.sweep import main

    sys.exit(main())
