"""Shape x fault testing ("like Jepsen for this runtime"): random DAGs of synthetic nodes, random
fault schedules, and a checker that holds every run to the delivery guarantee.

    from flowrl.testing.chaos import random_shape, simulate, random_schedule, run_shape
    shape = random_shape(3)                              # seeded DAG: chains, fan-out, joins, sinks
    expected = simulate(shape)                           # what every sink and stateful node must see
    sched = random_schedule(shape, expected, seed=0)     # 1-3 faults aimed at batches that happen
    res = run_shape(shape, tmp / "run", sched)           # run for real, then check
    assert res.ok, res.explain(shape)

Modules: `nodes` (synthetic node classes), `shapes` (the DAG generator), `model` (the expected
outcome, computed in-process), `schedules` (fault schedules), `check` (ledger, states, outcome),
`trial` (one run and its verdict, the time bound), `campaign` (many, a few at a time),
`features` (which newer runtime knobs this checkout has).
"""

from flowrl.testing.chaos.campaign import campaign, plan
from flowrl.testing.chaos.check import (
    check_ledger,
    compare_state,
    load_checkpoint_file,
    read_final_states,
)
from flowrl.testing.chaos.features import Features
from flowrl.testing.chaos.model import Expected, simulate
from flowrl.testing.chaos.schedules import Schedule, random_schedule
from flowrl.testing.chaos.shapes import NodeDef, Shape, Timing, random_shape
from flowrl.testing.chaos.trial import TrialResult, bound_s, run_shape

__all__ = [
    "Expected", "Features", "NodeDef", "Schedule", "Shape", "Timing", "TrialResult", "bound_s", "campaign",
    "check_ledger", "compare_state", "load_checkpoint_file", "plan", "random_schedule", "random_shape",
    "read_final_states", "run_shape", "simulate",
]
