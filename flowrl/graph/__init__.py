"""Graph files: typed spec, YAML loading with locations, structural checks."""

from flowrl.graph.errors import FlowrlError, GraphError, Problem
from flowrl.graph.kinds import BUILTIN_KINDS, resolve_kind
from flowrl.graph.loader import dump_graph, load_graph, load_graph_text
from flowrl.graph.spec import (
    EdgeSpec,
    FailurePolicy,
    GraphSpec,
    LauncherSpec,
    NodeSpec,
    ScheduleSpec,
    SupervisionSpec,
    ServiceSpec,
    WeightEdgeSpec,
)
from flowrl.graph.structure import check_structure, node_classes

__all__ = [
    "BUILTIN_KINDS", "EdgeSpec", "FailurePolicy", "FlowrlError", "GraphError", "GraphSpec",
    "LauncherSpec", "NodeSpec", "Problem", "ScheduleSpec", "ServiceSpec", "SupervisionSpec", "WeightEdgeSpec",
    "check_structure", "dump_graph", "load_graph", "load_graph_text", "node_classes", "resolve_kind",
]
