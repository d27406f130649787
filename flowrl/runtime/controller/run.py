"""`flowrl run GRAPH`: load, check, plan, write the run directory, run the controller.

    flowrl run graphs/ppo.yaml
    flowrl run graphs/ppo.yaml schedule.steps=20 --run-dir runs/short
    flowrl run --resume runs/short --steps 40

Exit status: 0 only when the run reached its configured end; 1 when it failed (the message names
the node and why); 2 when the graph, the inventory or a fault spec cannot be used; 130/143 when
interrupted (every node process is stopped first).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

from flowrl.errors import FlowrlError
from flowrl.graph import GraphError, Problem, dump_graph, load_graph


def _print_err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def prepare(args) -> tuple:
    """Graph, plan and run directory for a run (or a resumed one). Raises GraphError."""
    from flowrl.placement import get_inventory, make_plan
    from flowrl.runtime.protocol.faults import FaultSpecError, parse_faults

    resume = None
    if args.resume:
        from flowrl.runtime.protocol.checkpoints import CheckpointError, read_latest

        run_dir = Path(args.resume)
        try:
            resume = read_latest(run_dir)
        except CheckpointError as e:
            raise GraphError([Problem("", str(e), "resume a run directory that has a committed checkpoint",
                                      str(run_dir))]) from None
        overrides = list(args.overrides or [])
        spec = load_graph(run_dir / "graph.yaml", overrides)
    else:
        spec = load_graph(args.graph, list(args.overrides or []))
        run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if run_dir.exists() and not run_dir.is_dir():
        raise GraphError([Problem("--run-dir", f"{run_dir} exists and is not a folder",
                                  "give a new folder (or an existing run's) as --run-dir")])
    if args.steps is not None:
        spec.schedule.steps = args.steps
    for fault, text in zip(parse_faults(texts := list(spec.faults) + list(args.fault or [])), texts):
        if fault.node not in spec.nodes:  # a fault that could never fire would make a test pass unfaulted
            host = next((h for h, n in spec.nodes.items() if fault.node in n.fused), None)
            why = (f"{fault.node!r} runs inside the process of {host!r} (fuse_into); fault {host!r}, or give it a process "
                   f"of its own with nodes.{fault.node}.fuse_into=null") if host else f"nodes are {', '.join(spec.nodes)}"
            raise FaultSpecError(f"fault {text!r}: no node {fault.node!r} runs in this graph; {why}")
    inventory = get_inventory(getattr(args, "inventory", None))
    plan = make_plan(spec, inventory)
    return spec, plan, run_dir, resume


def run_main(args) -> int:
    from flowrl.runtime.protocol.faults import FaultSpecError

    logging.basicConfig(level=os.environ.get("FLOWRL_LOG_LEVEL", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec, plan, run_dir, resume = prepare(args)
    except GraphError as e:
        _print_err(str(e))
        return 2
    except FaultSpecError as e:
        _print_err(f"bad --fault: {e}")
        return 2
    errors = plan.errors
    if args.dry_run or errors:
        from rich.console import Console

        from flowrl.placement.check import render

        render(plan, str(args.graph or run_dir / "graph.yaml"), Console(width=None if sys.stdout.isatty() else 140,
                                                                        highlight=False))
        if errors:
            _print_err(f"{len(errors)} placement error(s): fix them before running (flowrl check {args.graph or ''})")
            return 1
        return 0
    return execute(spec, plan, run_dir, resume=resume, faults=list(args.fault or []),
                   metrics_port=args.metrics_port, quiet=getattr(args, "quiet", False),
                   inventory=getattr(args, "inventory", None))


def preload_modules(spec, plan) -> list[str]:
    """What the local fork server imports before it forks: each node class's `preload`, in the
    graph's order without repeats, and torch first when the runtime itself will use it in a node
    process: a checkpoint (`torch.save` of a stateful node's state), a torch.distributed group (a
    node that publishes or subscribes weights, or one of several ranks)."""
    from flowrl.graph import node_classes

    classes = list(node_classes(spec).values())  # a host's class has its fused nodes' preload too
    modules = [name for cls in classes for name in cls.preload]
    if (any(c.stateful or c.publishes_weights or c.subscribes_weights for c in classes)
            or any(e.world_size > 1 for e in plan.entries)):
        modules.insert(0, "torch")
    return list(dict.fromkeys(modules))


def execute(spec, plan, run_dir: Path, *, resume=None, faults=(), metrics_port=None, quiet=False, inventory=None,
            launcher: str = "local") -> int:
    import anyio

    from flowrl.metrics import MetricsHub
    from flowrl.runtime.controller.controller import Controller, RunFailed
    from flowrl.runtime.launch import make_launcher
    from flowrl.runtime.protocol.loops import run_options

    old_umask = os.umask(0o077)  # the run directory and everything in it: its owner's only
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    run_dir = run_dir.resolve()  # node processes get absolute paths; the run directory can move later
    (run_dir / "graph.yaml").write_text(dump_graph(spec))
    (run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
    hub = MetricsHub(run_dir, devices=graph_summary(spec, plan)["devices"] or 1, cpu=True)
    server = None
    if metrics_port is not None:
        from flowrl.metrics import serve_prometheus

        server = serve_prometheus(hub, port=metrics_port, host="127.0.0.1")
        print(f"prometheus metrics on http://127.0.0.1:{server.port}/metrics", flush=True)
    try:
        launcher_obj = make_launcher(spec.launcher.type if launcher == "local" else launcher,
                                     address=spec.launcher.address, preload=preload_modules(spec, plan))
    except FlowrlError as e:  # e.g. no Ray, or no Ray cluster at launcher.address
        _print_err(f"flowrl: {e}")
        hub.close()
        if server:
            server.close()
        os.umask(old_umask)
        return 2
    print(f"flowrl: run {spec.name} -> {run_dir}", flush=True)
    summary = graph_summary(spec, plan)
    view = _live_view(hub, summary, quiet, run_dir)
    controller = None
    code, froze = 0, False
    try:  # the controller places every process first: a host it cannot place is a RunFailed too
        controller = Controller(spec, plan, run_dir, launcher_obj, faults=list(faults), resume=resume, hub=hub,
                                inventory=inventory, on_tick=lambda c: view.update(), summary=summary)
        if froze := gc.get_freeze_count() == 0:  # (a caller that froze objects itself decides)
            gc.collect()  # what start-up left over goes now; what it built lives the run: frozen,
            gc.freeze()   # the cyclic collector's full passes skip it (~20 ms each, a few a run)
        with view:
            anyio.run(controller.run, backend_options=run_options())
    except RunFailed as e:
        _print_err(f"flowrl: run failed: {e}")
        code = 128 + controller.interrupted if controller is not None and controller.interrupted else 1
    except KeyboardInterrupt:
        code = 130
    finally:
        from flowrl.metrics import write_status

        write_status(run_dir, hub.live_state(), phase="finished" if code == 0 else "failed", graph=summary)
        hub.close()
        if server:
            server.close()
        launcher_obj.close()
        os.umask(old_umask)
        if froze:
            gc.unfreeze()  # a process that runs again (a test's) lets this run's objects go
    if code == 0:
        print(f"flowrl: finished {spec.schedule.steps} steps; run directory {run_dir}", flush=True)
    return code


def graph_summary(spec, plan) -> dict:
    return {"name": spec.name, "nodes": {n: node.replicas for n, node in spec.nodes.items()},
            "edges": [f"{e.src}->{e.dst}" for e in spec.edges], "total_steps": spec.schedule.steps,
            "devices": len({(e.host, tuple(e.devices)) for e in plan.entries})}


def _live_view(hub, summary: dict, quiet: bool, run_dir: Path):
    from flowrl.metrics import LiveView

    return LiveView(hub, summary, plain=True if quiet else None, status_dir=run_dir)
