"""python -m convert SRC OUT: convert a LLaDA or Dream checkpoint, whichever config.json names."""

import sys

from convert import main

sys.exit(main())
