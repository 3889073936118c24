"""Multiple-choice tasks scored by log-likelihood through lm-eval: python experiments/eval_likelihood.py

The command line of `localleap_jax.commands.eval_likelihood` (its --help and docstring say the rest)."""

import sys

from localleap_jax import cli

if __name__ == "__main__":
    cli.guard_startup()  # a Ctrl-C while the imports below load: one line, exit 130
    from localleap_jax.commands.eval_likelihood import main

    sys.exit(main())
