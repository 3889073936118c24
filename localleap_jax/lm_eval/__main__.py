"""`python -m localleap_jax.lm_eval`: the `lm_eval` command with the `localleap` model registered."""

import sys

from localleap_jax.lm_eval.cli import main

sys.exit(main())
