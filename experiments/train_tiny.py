"""Train the small embedded models on synthetic GSM8K-format problems: python experiments/train_tiny.py --out DIR

The command line of `localleap_jax.commands.train_tiny` (its --help and docstring say the rest)."""

import sys

from localleap_jax import cli

if __name__ == "__main__":
    cli.guard_startup()  # a Ctrl-C while the imports below load: one line, exit 130
    from localleap_jax.commands.train_tiny import main

    sys.exit(main())
