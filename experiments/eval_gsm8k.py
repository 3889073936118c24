"""GSM8K with lm-eval-harness's protocol, decoding strategies side by side: python experiments/eval_gsm8k.py

The command line of `localleap_jax.commands.eval_gsm8k` (its --help and docstring say the rest)."""

import sys

from localleap_jax import cli

if __name__ == "__main__":
    cli.guard_startup()  # a Ctrl-C while the imports below load: one line, exit 130
    from localleap_jax.commands.eval_gsm8k import main

    sys.exit(main())
