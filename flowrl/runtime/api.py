"""`flowrl.run`: the Python entry point, for notebooks and scripts.

    import flowrl
    summary = flowrl.run("graphs/grpo.yaml", overrides=["schedule.steps=10"], run_dir="runs/try")
    summary.exit_code, summary.run_dir, summary.metrics[-1]["reward_mean"]

Runs in this process (the controller) and starts node processes like `flowrl run` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flowrl.graph import GraphSpec, load_graph


@dataclass
class RunSummary:
    exit_code: int
    run_dir: Path

    @property
    def metrics(self) -> list[dict]:
        from flowrl.segments import read_all

        return read_all(self.run_dir / "metrics.jsonl")

    @property
    def ledger(self) -> list[dict]:
        from flowrl.runtime.protocol.ledger import read_ledger

        return read_ledger(self.run_dir)


def run(graph: str | Path | GraphSpec, *, overrides: list[str] = (), run_dir: str | Path | None = None,
        steps: int | None = None, faults: list[str] = (), inventory: str | None = None,
        quiet: bool = True) -> RunSummary:
    import time

    from flowrl.graph import check_structure
    from flowrl.placement import get_inventory, make_plan
    from flowrl.runtime.controller.run import execute

    if isinstance(graph, GraphSpec):
        spec = graph.model_copy(deep=True)
        check_structure(spec)
    else:
        spec = load_graph(graph, list(overrides))
    if steps is not None:
        spec.schedule.steps = steps
    run_dir = Path(run_dir) if run_dir else Path("runs") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    plan = make_plan(spec, get_inventory(inventory))
    errors = plan.errors
    if errors:
        from flowrl.graph import GraphError, Problem

        raise GraphError([Problem(f"nodes.{f.node}", f.message, "see `flowrl check`") for f in errors])
    code = execute(spec, plan, run_dir, faults=list(faults), quiet=quiet, inventory=inventory)
    return RunSummary(code, run_dir)


def scale(run_dir: str | Path, node: str, replicas: int, timeout_s: float = 30.0) -> str:
    """Run `replicas` replicas of stateless node `node` in the running run at `run_dir` (the same
    as `flowrl scale RUN_DIR node=N`). Returns what changed; raises ScaleError with the reason."""
    from flowrl.runtime.controller.scaling import request

    return request(run_dir, node, replicas, timeout_s)
