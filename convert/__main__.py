"""python -m convert SRC OUT [--family NAME]: convert a LLaDA, Dream or SDAR checkpoint."""

import sys

from localleap_jax import cli

cli.guard_startup()  # a Ctrl-C while JAX, Orbax and transformers load: one line, nothing written

from convert import main  # noqa: E402

sys.exit(main())
