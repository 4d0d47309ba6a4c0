"""``python -m burncoll``: the ``burncoll`` command (:mod:`burncoll.cli`)."""

import sys

from burncoll.cli import main

sys.exit(main())
