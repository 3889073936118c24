"""`python -m localleap_jax.plan`: memory per device and bytes per pass of a generation, planned from a config.json on
any host (a TPU topology through libtpu). The command line of `localleap_jax.commands.plan` (its --help and docstring
say the rest)."""

import sys

from localleap_jax import cli

if __name__ == "__main__":
    cli.guard_startup()  # a Ctrl-C while the imports below load: one line, exit 130
    from localleap_jax.commands.plan import main

    sys.exit(main())
