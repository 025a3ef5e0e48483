"""``python -m scaletrain`` is the ``scaletrain`` command."""

import sys

from scaletrain.commands.cli import main

sys.exit(main())
