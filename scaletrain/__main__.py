"""``python -m scaletrain`` is the ``scaletrain`` command."""

import sys

from scaletrain.cli import main

sys.exit(main())
