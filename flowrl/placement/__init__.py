"""Devices and placement: which devices exist (inventory), where each node process runs (plan),
and what is wrong with that (findings). `flowrl check` prints all three.

    from flowrl.placement import get_inventory, make_plan
    plan = make_plan(spec, get_inventory(args.inventory))
    if not plan.ok: ...
    env = plan.env_for(plan.entries[0], master_port=29500)
"""

from flowrl.placement.devices import Device, GpuProcess, Host, Inventory
from flowrl.placement.errors import InventoryError
from flowrl.placement.findings import CODES, Finding
from flowrl.placement.inventory import get_inventory
from flowrl.placement.plan import Plan, PlanEntry
from flowrl.placement.planner import make_plan

__all__ = [
    "CODES", "Device", "Finding", "GpuProcess", "Host", "Inventory", "InventoryError", "Plan", "PlanEntry",
    "get_inventory", "make_plan",
]
