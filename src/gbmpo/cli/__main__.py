"""``python -m gbmpo.cli``: the ``gbmpo`` command."""

import sys

from gbmpo.cli import main

sys.exit(main())
