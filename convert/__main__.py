"""python -m convert SRC OUT: convert a LLaDA, Dream or SDAR checkpoint, whichever config.json names."""

import sys

from convert import main

sys.exit(main())
