"""Shape x fault testing: the entry points of `flowrl.testing.chaos`, under the name tests use.

    from flowrl.testing.shapes import campaign, random_shape, random_schedule, run_shape, simulate

See `flowrl.testing.chaos` for the parts (synthetic nodes, DAG generator, model, schedules, checker).
"""

from flowrl.testing.chaos import *
from flowrl.testing.chaos import __all__  # noqa: F401
