"""`python -m localleap_jax.lm_eval`: the `lm_eval` command with the `localleap` model registered."""

import sys

from localleap_jax import cli

cli.guard_startup()  # a Ctrl-C while lm-eval, JAX and transformers load: one line, exit 130

from localleap_jax.lm_eval.cli import main  # noqa: E402

sys.exit(main())
