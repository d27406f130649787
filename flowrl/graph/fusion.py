"""Light nodes fused into a neighbour's process (`fuse_into`): the graph the runtime runs.

    reward:
      kind: reward
      config: {task: *task}
      fuse_into: rollout        # scored inside the rollout's process, as part of each of its calls

A fused node runs in its host's process, as part of the host's call: the host's output on the port
that fed the fused node goes through the fused node's `process` before it is sent on
(flowrl.runtime.worker.fused). The runtime sees the graph without the fused node: the host's edge
to it is gone, the fused node's own out edges leave from that port of the host, and the host's
`fused` lists it (`fuse` rewrites the spec in place; the run directory's graph.yaml holds the
result). No channel, no process and no message between the two, and nothing else changes: the
host's ticket, the records of its outputs (exactly once), its restarts and replays cover the fused
call. What it saves: a process's framework time per step (its event loop, sockets, heartbeats and
metrics), a hop of every batch, and the controller's bookkeeping of one more process
(docs/benchmarks.md, "Fewer processes").

A source fuses into its consumer the other way round: `prompts: {fuse_into: rollout}` makes the
rollout's process the source. It takes the tickets, and each call generates the prompts and
samples them (then runs what is fused after it); the edge between the two goes.

What may be fused (else `flowrl check` says which rule broke and how to fix it):
- the fused node: one input port (or a source) and one output port; not stateful, no weights, not a
  join; no placement or failure policy of its own (it has its host's); not in `services:` or
  `weights:`;
- a transform: its input is exactly one edge, from its host, whose port feeds nothing else
  (another consumer's input must not change);
- a source: its output is exactly one edge, the host's only input; the host is stateless and has
  an output;
- the host: one rank per replica (no `mesh`, no several devices per replica).
Chains fuse too: `b: {fuse_into: a}`, `c: {fuse_into: b}` runs a, then b, then c in a's process.
"""

from __future__ import annotations

import difflib

from flowrl.graph.errors import Problem, problem_at
from flowrl.graph.kinds import KindError, resolve_kind
from flowrl.graph.shapes import is_source
from flowrl.graph.spec import FailurePolicy, GraphSpec, NodeSpec

#: What a fused node leaves to its host: these fields must keep their defaults.
HOSTS_FIELDS = {"replicas": 1, "devices": "auto", "mesh": None, "host": None, "colocate_with": [],
                "take_turns": False, "concurrency": 1, "on_failure": FailurePolicy()}


def host_class(cls: type, fused: dict[str, type]) -> type:
    """The class the rest of the runtime sees for a host with `fused` nodes (name -> class): its
    own, with every fused node's `preload`, and a source (no inputs) when a source is fused into it.
    The node process runs a subclass of it that calls the fused nodes (runtime/worker/fused.py)."""
    if not fused:
        return cls
    from flowrl.node import Source

    attrs = {"preload": tuple(dict.fromkeys(cls.preload + tuple(m for c in fused.values() for m in c.preload))),
             "__module__": cls.__module__}
    source = any(is_source(c) for c in fused.values())
    if source:
        attrs["inputs"] = ()
    return type(f"{cls.__name__}+{'+'.join(fused)}", (Source, cls) if source else (cls,), attrs)


def fused_port(fused: NodeSpec) -> str:
    """The host's port of a fused entry (`fuse` writes `fuse_into` as HOST.PORT): the output port
    a fused transform takes, or the input port a fused source feeds."""
    return fused.fuse_into.partition(".")[2]


def _node_problems(spec: GraphSpec, name: str, cls: type, classes: dict[str, type], located) -> list[Problem]:
    """Rules on the fused node itself and its edges (before any rewrite)."""
    from flowrl.node import Join

    node, loc = spec.nodes[name], ("nodes", name, "fuse_into")
    target = node.fuse_into.partition(".")[0]
    out: list[Problem] = []
    if target not in spec.nodes:
        close = difflib.get_close_matches(target, [n for n in spec.nodes if n != name], n=1)
        return [problem_at(located, loc, f"node {name!r}: fuse_into names unknown node {target!r}",
                         f"did you mean {close[0]!r}?" if close else f"nodes are {', '.join(spec.nodes)}")]
    if target == name:
        return [problem_at(located, loc, f"node {name!r} is fused into itself", "name the node whose output it takes")]
    kind = f"{name!r} ({node.kind})"
    source = is_source(cls)
    if len(cls.outputs) != 1 or (len(cls.inputs) != 1 and not source) or issubclass(cls, Join):
        out.append(problem_at(located, loc, f"node {kind} has input ports {list(cls.inputs)} and output ports "
                            f"{list(cls.outputs)}; only a node with one of each (or a source with one output) "
                            "runs inside another's call", "give it a process of its own (remove fuse_into)"))
    if cls.stateful or cls.publishes_weights or cls.subscribes_weights:
        what = "is stateful (its state is checkpointed)" if cls.stateful else "takes part in weight sync"
        out.append(problem_at(located, loc, f"node {kind} {what}; only a stateless node without weights can be fused",
                            "give it a process of its own (remove fuse_into)"))
    for field, default in HOSTS_FIELDS.items():
        if getattr(node, field) != default:
            out.append(problem_at(located, ("nodes", name, field), f"node {name!r} is fused into {target!r} and sets "
                                f"{field}; a fused node runs on its host's devices, replicas and failure policy",
                                f"remove {field} (set it on {target!r}), or remove fuse_into"))
    out += (_source_edges if source else _edges)(spec, name, target, classes, located)
    for kind_, items in (("weight edge", spec.weights), ("service", spec.services)):
        for item in items:
            if name in (item.src, item.dst):
                out.append(problem_at(located, loc, f"node {name!r} is fused and named by the {kind_} {item}",
                                    "a fused node has no process to sync or serve; remove fuse_into"))
    for other, spec_ in spec.nodes.items():
        if name in spec_.colocate_with:
            out.append(problem_at(located, ("nodes", other, "colocate_with"), f"node {other!r} is colocated with "
                                f"{name!r}, which is fused into {target!r} and has no devices of its own",
                                f"write colocate_with: [{target}]"))
    return out


def _edges(spec: GraphSpec, name: str, target: str, classes, located) -> list[Problem]:
    """A transform fused after its host: its one input edge comes from the host's port, which
    feeds nothing else."""
    node, loc = spec.nodes[name], ("nodes", name, "fuse_into")
    ins = [e for e in spec.edges if e.dst == name]
    if len(ins) != 1 or ins[0].src != target:
        shown = ", ".join(str(e) for e in ins) or "none"
        return [problem_at(located, loc, f"node {name!r} is fused into {target!r} but its input edges are [{shown}]; "
                         f"a fused node takes exactly one edge, from its host",
                         f"make '{target} -> {name}' its only input, or remove fuse_into")]
    port = ins[0].src_port
    if node.fuse_into != target and port != fused_port(node):
        return [problem_at(located, loc, f"node {name!r}: fuse_into {node.fuse_into!r} names port "
                         f"{fused_port(node)!r} but its input comes from {target}.{port}", f"write fuse_into: {target}")]
    others = [str(e) for e in spec.edges if e.src == target and e.src_port == port and e.dst != name]
    if others:
        return [problem_at(located, loc, f"node {name!r} is fused into {target!r}, whose port {port!r} also feeds "
                         f"{', '.join(others)}; fusing would change what they receive",
                         f"give {name!r} a process of its own, or feed the others from {name!r}")]
    return []


def _source_edges(spec: GraphSpec, name: str, target: str, classes, located) -> list[Problem]:
    """A source fused before its consumer: its one output edge is the host's only input, and the host
    becomes the source (a stateless node with one input port and an output)."""
    loc = ("nodes", name, "fuse_into")
    outs = [e for e in spec.edges if e.src == name]
    if len(outs) != 1 or outs[0].dst != target:
        shown = ", ".join(str(e) for e in outs) or "none"
        return [problem_at(located, loc, f"source {name!r} is fused into {target!r} but its output edges are "
                         f"[{shown}]; a fused source feeds exactly one edge, into its host",
                         f"make '{name} -> {target}' its only output, or remove fuse_into")]
    node = spec.nodes[name]
    if node.fuse_into != target and outs[0].dst_port != fused_port(node):
        return [problem_at(located, loc, f"source {name!r}: fuse_into {node.fuse_into!r} names port "
                         f"{fused_port(node)!r} but it feeds {target}.{outs[0].dst_port}", f"write fuse_into: {target}")]
    host = classes[target]
    ins = [str(e) for e in spec.edges if e.dst == target]
    if len(host.inputs) != 1 or len(ins) != 1 or host.stateful or not host.outputs:
        why = ("is stateful" if host.stateful else "has no output" if not host.outputs
               else f"has inputs [{', '.join(ins)}]")
        return [problem_at(located, loc, f"source {name!r} is fused into {target!r}, which {why}; a source runs "
                         "inside a stateless node with one input (that source's) and an output",
                         f"give {name!r} a process of its own (remove fuse_into)")]
    return []


def _host_problems(spec: GraphSpec, name: str, host: str, located) -> list[Problem]:
    h = spec.nodes[host]
    per_replica = h.devices if isinstance(h.devices, int) else (len(h.devices) // h.replicas
                                                                if isinstance(h.devices, list) else 1)
    if h.mesh is not None or per_replica > 1:
        return [problem_at(located, ("nodes", name, "fuse_into"), f"node {name!r} is fused into {host!r}, which runs "
                         f"{per_replica} ranks per replica; a fused node runs in single-rank hosts only",
                         f"give {name!r} a process of its own (remove fuse_into)")]
    return []


def fuse(spec: GraphSpec, classes: dict[str, type], located=None) -> list[Problem]:
    """Fold every node with `fuse_into` into its host (in place), or return the problems and change
    nothing. `classes`: node name -> class, edges' ports filled in (structure.check_structure).
    Removes the fused nodes' entries from `classes`."""
    pending = [n for n, node in spec.nodes.items() if node.fuse_into is not None]
    if not pending:
        return []
    problems = [p for n in pending for p in _node_problems(spec, n, classes[n], classes, located)]
    if problems:
        return problems
    host_of: dict[str, str] = {}
    while pending:  # hosts first: a chain b -> a, c -> b folds b into a, then c into a
        ready = [n for n in pending if spec.nodes[n].fuse_into.partition(".")[0] not in pending]
        if not ready:  # a fuse_into cycle has a data cycle too, which check_structure refuses first
            return [problem_at(located, ("nodes", pending[0], "fuse_into"), "fuse_into forms a cycle: "
                             + " -> ".join(pending), "fuse each node into the node whose output it takes")]
        for n in ready:
            target = spec.nodes[n].fuse_into.partition(".")[0]
            host_of[n] = host_of.get(target, target)
        problems = [p for n in ready for p in _host_problems(spec, n, host_of[n], located)]
        if problems:
            return problems
        for n in ready:
            _fold(spec, n, host_of[n], classes)
        pending = [n for n in pending if n not in ready]
    return []


def _fold(spec: GraphSpec, name: str, host: str, classes: dict[str, type]) -> None:
    node = spec.nodes.pop(name)
    if is_source(classes[name]):  # its edge into the host goes; the host takes its tickets
        (edge,) = [e for e in spec.edges if e.src == name]
        port = edge.dst_port
        spec.edges.remove(edge)
    else:
        (edge,) = [e for e in spec.edges if e.dst == name]  # from the host, or from what it was fused into
        port = edge.src_port
        spec.edges.remove(edge)
        for e in spec.edges:
            if e.src == name:
                object.__setattr__(e, "src", host)
                object.__setattr__(e, "src_port", port)
    spec.nodes[host].fused[name] = node.model_copy(update={"fuse_into": f"{host}.{port}"})
    del classes[name]


def fused_problems(spec: GraphSpec, located=None) -> list[Problem]:
    """A graph fused before (a run directory's graph.yaml): each fused entry's kind resolves, its
    config validates and its `fuse_into` names the node that holds it."""
    from pydantic import ValidationError

    from flowrl.graph.validation import problems_from_validation

    out: list[Problem] = []
    for host, node in spec.nodes.items():
        for name, f in node.fused.items():
            loc = ("nodes", host, "fused", name)
            try:
                cls = resolve_kind(f.kind)
            except KindError as e:
                out.append(problem_at(located, loc + ("kind",), str(e), "use a built-in kind or 'module:Class'"))
                continue
            if f.fuse_into is None or f.fuse_into.partition(".")[0] != host:
                out.append(problem_at(located, loc + ("fuse_into",), f"fused node {name!r} names host {f.fuse_into!r}, "
                                    f"not {host!r}", "fuse nodes with `fuse_into` on the node, not by writing `fused:`"))
            try:
                cls.Config.model_validate(f.config)
            except ValidationError as e:
                if located is not None:
                    out.extend(problems_from_validation(e, located, cls.Config, loc + ("config",)))
                else:
                    out.append(problem_at(None, loc + ("config",), str(e), "fix the fused node's config"))
    return out
