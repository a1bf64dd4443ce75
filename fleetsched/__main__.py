"""``python -m fleetsched``: the ``fleetsched`` command."""

import sys

from .cli import main

sys.exit(main())
