"""`flowrl check GRAPH [key.path=value ...] [--inventory FILE] [--json]`: the health check before launch.

    flowrl check graphs/ppo.yaml
    flowrl check examples/gpu/ppo-a100x8.yaml --inventory examples/inventories/a100x8-nvlink.yaml

Loads the graph, builds the inventory, plans, prints the plan (node -> replica -> rank -> host ->
physical devices -> local devices -> mesh) and every finding. Exit codes (DESIGN.md section 10):
0 no errors, 1 errors found, 2 graph or inventory cannot be loaded. Stays light: no torch import,
well under two seconds.
"""

from __future__ import annotations

import json
import sys

from flowrl.graph.errors import GraphError
from flowrl.placement.devices import GIB
from flowrl.placement.findings import ids_text
from flowrl.placement.plan import Plan

STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _devices(entry) -> str:
    if not entry.devices:
        return "cpu (unpinned)" if entry.device_type == "cpu" else "-"
    unit = "GPU" if entry.device_type == "cuda" else "core"
    return f"{unit} {ids_text(entry.devices)}"


def render(plan: Plan, graph: str, console) -> None:
    """The plan as a table, then the findings, then a one-line verdict."""
    from rich.table import Table

    console.print(f"[bold]flowrl check[/] {graph}\n[dim]inventory: {plan.inventory}[/]")
    multi_host = len({e.host for e in plan.entries}) > 1
    table = Table(show_edge=False, header_style="bold", pad_edge=False)
    for col in ("node", "replica", "rank", "host", "devices", "local", "mesh", "env"):
        table.add_column(col, no_wrap=True)
    last = (None, None)
    for e in plan.entries:
        node = e.node if e.node != last[0] else ""
        replica = str(e.replica) if (e.node, e.replica) != last else ""
        if e.device_type == "cuda":
            env = f"CUDA_VISIBLE_DEVICES={','.join(map(str, e.visible_devices))}"
        else:
            env = f"FLOWRL_CPU_CORES={','.join(map(str, e.devices))}" if e.devices else ""
        mesh = "x".join(map(str, e.mesh)) + (f" @{tuple(e.mesh_coord)}" if len(e.mesh) > 1 else "")
        table.add_row(node, replica, f"{e.rank}/{e.world_size}", e.host, _devices(e),
                      ",".join(map(str, e.local_devices)) or "-", mesh, env,
                      end_section=False)
        last = (e.node, e.replica)
    console.print(table)
    _memory(plan, multi_host, console)
    if plan.findings:
        import textwrap

        console.print()
        for f in plan.findings:
            unit = "GPU" if plan.device_type == "cuda" else "core"
            where = f" on {f.host}" if multi_host and f.host else ""
            devs = f"  {unit} {ids_text(f.devices)}{where}" if f.devices else ""
            node = f"  [bold]{f.node}[/]" if f.node else ""
            console.print(f"[{STYLE[f.severity]}]{f.severity:<8}[/]{f.code}{node}{devs}")
            console.print(textwrap.fill(f.message, width=max(60, console.width - 2), initial_indent=" " * 8,
                                        subsequent_indent=" " * 8, break_on_hyphens=False), markup=False)
    n_err, n_warn = len(plan.errors), len(plan.warnings)
    n_info = len(plan.findings) - n_err - n_warn
    verdict = "[bold red]errors found[/]" if n_err else "[bold green]ok[/]"
    console.print(f"\n{len(plan.entries)} processes; {n_err} error(s), {n_warn} warning(s), {n_info} note(s): {verdict}")


def _memory(plan: Plan, multi_host: bool, console) -> None:
    """Per set of GPUs: what the memory model puts there, `max(a, b) turns` for nodes taking turns."""
    if not plan.memory:
        return
    console.print("\n[bold]memory per GPU[/] [dim](flowrl's estimate: docs/placement.md, memory model)[/]")
    for row in plan.memory:
        where = f" on {row['host']}" if multi_host else ""
        cap, used = row["capacity_bytes"], row["bytes"]
        summed = (f" (summed: {row['summed_bytes'] / GIB:,.1f} GiB)"
                  if row["turns"] and row["summed_bytes"] != used else "")
        text = f"{row['text']} = {used / GIB:,.1f} GiB" if row.get("shared", True) else row["text"]
        console.print(f"  GPU {ids_text(row['devices'])}{where}: {text} of "
                      f"{cap / GIB:,.0f} GiB ({used / cap:.0%}){summed}", markup=False)


def check_graph(graph: str, overrides=(), inventory: str | None = None) -> Plan:
    """Load the graph and the inventory and plan: what `flowrl check` does before printing.

    Raises GraphError (an InventoryError is one) for input that cannot be used; any other
    exception is a flowrl bug.
    """
    from flowrl.graph import load_graph
    from flowrl.placement.inventory import get_inventory
    from flowrl.placement.planner import make_plan

    spec = load_graph(graph, list(overrides or []))
    return make_plan(spec, get_inventory(inventory))


def check_main(args) -> int:
    """Entry point of `flowrl check` (called by flowrl/cli.py). Returns the exit code."""
    try:
        plan = check_graph(args.graph, getattr(args, "overrides", None), getattr(args, "inventory", None))
    except GraphError as e:
        print(str(e), file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(plan.to_json(), indent=2))
    else:
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 140, highlight=False)
        render(plan, args.graph, console)
    return 1 if plan.errors else 0
