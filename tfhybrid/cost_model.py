"""The cost model's old import path, kept for saved code: every name is ``tfhybrid.plan``'s.

Deprecated: ``tfhybrid.plan`` is the planner's path; this module re-exports its names for
saved code and warns once on import, naming the new path.
"""

from __future__ import annotations

import warnings

from tfhybrid.plan import *  # noqa: F401,F403
from tfhybrid.plan import __all__  # noqa: F401

warnings.warn("tfhybrid.cost_model is deprecated: import the same names from tfhybrid.plan",
              DeprecationWarning, stacklevel=2)
