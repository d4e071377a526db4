"""``python -m commpress``: the same as the ``commpress`` console script."""

import sys

from commpress.cli import main

sys.exit(main())
