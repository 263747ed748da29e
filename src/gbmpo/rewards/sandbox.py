"""The sandbox's former home: this module path is an alias of :mod:`gbmpo.sandbox.client`.

``import gbmpo.rewards.sandbox`` gives that very module object (not a copy of its names), so code
that imports from here or sets its attributes (``_default``, as tests do) keeps working.
"""

import sys

from gbmpo.sandbox import client

sys.modules[__name__] = client
