"""Structural checks of a graph: kinds resolve, ports exist and are connected, no data cycles.

Runs after typed validation. Resolves each node's kind to its class (ports, roles, config model),
fills in default ports on edges, validates each node's `config:` against its class's `Config`, and
raises one `GraphError` with every problem found.
"""

from __future__ import annotations

from collections import defaultdict

from pydantic import ValidationError

from flowrl.graph.errors import GraphError, Problem, problem_at
from flowrl.graph.fusion import fuse, fused_problems, host_class
from flowrl.graph.kinds import KindError, resolve_kind
from flowrl.graph.shapes import is_observer, is_source
from flowrl.graph.spec import GraphSpec


def node_classes(spec: GraphSpec) -> dict[str, type]:
    """Resolve every node's kind (raises GraphError naming each unresolvable one); a node with
    fused nodes gets its `fusion.host_class`."""
    classes, problems = {}, []
    located = spec.__dict__.get("_located")
    for name, node in spec.nodes.items():
        fused = {}
        for f, n in node.fused.items():
            try:
                fused[f] = resolve_kind(n.kind)
            except KindError:
                pass  # fused_problems names it
        try:
            classes[name] = host_class(resolve_kind(node.kind), fused)
        except KindError as e:
            problems.append(problem_at(located, ("nodes", name, "kind"), str(e), "use a built-in kind or 'module:Class'"))
    if problems:
        raise GraphError(problems)
    return classes


def _find_cycle(nodes, adjacency) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in adjacency[n]:
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None

    for n in nodes:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def check_structure(spec: GraphSpec, located=None) -> dict[str, type]:
    """Check kinds, ports, edges, weight edges, cycles and node configs, then fold the nodes that
    say `fuse_into` into their hosts (fusion.py). Returns the classes of the nodes that remain."""
    located = located or spec.__dict__.get("_located")
    classes = node_classes(spec)
    problems: list[Problem] = []
    incoming: dict[tuple[str, str], int] = defaultdict(int)
    outgoing: dict[tuple[str, str], int] = defaultdict(int)
    seen_edges: set[tuple] = set()
    adjacency: dict[str, list[str]] = defaultdict(list)

    for i, edge in enumerate(spec.edges):
        loc = ("edges", i)
        ok = True
        for side, name in (("from", edge.src), ("to", edge.dst)):
            if name not in spec.nodes:
                import difflib

                close = difflib.get_close_matches(name, spec.nodes, n=1)
                problems.append(problem_at(located, loc, f"edge {edge}: no node named {name!r}",
                                   f"did you mean {close[0]!r}?" if close else f"nodes are {', '.join(spec.nodes)}"))
                ok = False
        if not ok:
            continue
        for attr, cls_ports, direction in (("src_port", classes[edge.src].outputs, "output"),
                                           ("dst_port", classes[edge.dst].inputs, "input")):
            node = edge.src if attr == "src_port" else edge.dst
            port = getattr(edge, attr)
            if port is None:
                if len(cls_ports) == 1:
                    object.__setattr__(edge, attr, cls_ports[0])  # fill the default without revalidation
                else:
                    have = ", ".join(cls_ports) if cls_ports else "none"
                    problems.append(problem_at(located, loc, f"edge {edge}: node {node!r} ({spec.nodes[node].kind}) has "
                                       f"{direction} ports [{have}], so the edge must name one",
                                       f"write '{node}.<port>'" if cls_ports else f"{node!r} takes no {direction}"))
                    ok = False
            elif port not in cls_ports:
                problems.append(problem_at(located, loc, f"edge {edge}: node {node!r} has no {direction} port {port!r}",
                                   f"its {direction} ports are [{', '.join(cls_ports) or 'none'}]"))
                ok = False
        if not ok:
            continue
        key = (edge.src, edge.src_port, edge.dst, edge.dst_port)
        if key in seen_edges:
            problems.append(problem_at(located, loc, f"edge {edge} is declared twice (duplicate)", "remove one of them"))
        seen_edges.add(key)
        outgoing[(edge.src, edge.src_port)] += 1
        incoming[(edge.dst, edge.dst_port)] += 1
        adjacency[edge.src].append(edge.dst)

    servers = _service_problems(spec, classes, located, problems)
    if not problems:
        for name, cls in classes.items():
            if name in servers and not any(name in (e.src, e.dst) for e in spec.edges):
                continue  # a node that only serves requests (a rollout behind agents) has no data edges
            for port in cls.inputs:
                if not incoming[(name, port)]:
                    problems.append(problem_at(located, ("nodes", name), f"input port {name}.{port} is not connected (dangling)",
                                       f"add an edge 'producer -> {name}.{port}'"))
            for port in cls.outputs:
                if not outgoing[(name, port)]:
                    problems.append(problem_at(located, ("nodes", name), f"output port {name}.{port} is not connected (dangling)",
                                       f"add an edge '{name}.{port} -> consumer'"))
        cycle = _find_cycle(list(spec.nodes), adjacency)
        if cycle:
            problems.append(problem_at(located, ("edges",), f"data edges form a cycle: {' -> '.join(cycle)}",
                               "data must flow one way; send weights back with a `weights:` edge (trainer -> subscriber)"))

    for i, w in enumerate(spec.weights):
        loc = ("weights", i)
        for name in (w.src, w.dst):
            if name not in spec.nodes:
                problems.append(problem_at(located, loc, f"weight edge {w}: no node named {name!r}", f"nodes are {', '.join(spec.nodes)}"))
        if w.src in classes and not classes[w.src].publishes_weights:
            problems.append(problem_at(located, loc, f"weight edge {w}: {w.src!r} ({spec.nodes[w.src].kind}) does not publish weights",
                               "the source of a weight edge must be a trainer such as `actor`"))
        if w.dst in classes and not classes[w.dst].subscribes_weights:
            problems.append(problem_at(located, loc, f"weight edge {w}: {w.dst!r} ({spec.nodes[w.dst].kind}) does not take weights",
                               "the target of a weight edge must be a subscriber such as `rollout`"))

    for name, node in spec.nodes.items():
        for other in node.colocate_with:
            if other not in spec.nodes:
                problems.append(problem_at(located, ("nodes", name, "colocate_with"), f"colocate_with names unknown node {other!r}",
                                   f"nodes are {', '.join(spec.nodes)}"))
        if node.take_turns and not node.colocate_with and not any(name in n.colocate_with for n in spec.nodes.values()):
            problems.append(problem_at(located, ("nodes", name, "take_turns"), f"node {name!r} takes turns with no one",
                               "declare the nodes it shares its devices with: `colocate_with: [actor]`"))
        try:
            classes[name].Config.model_validate(node.config)
        except ValidationError as e:
            from flowrl.graph.reading import Located
            from flowrl.graph.validation import problems_from_validation

            loc_src = located or Located({}, {}, None)
            problems.extend(problems_from_validation(e, loc_src, classes[name].Config, ("nodes", name, "config")))

    problems.extend(_async_problems(classes, spec, located))
    if not any(is_source(cls) for cls in classes.values()):
        problems.append(problem_at(located, ("nodes",), "the graph has no source node (a node without inputs)",
                           "add a source such as `prompts` that turns tickets into batches"))
    problems.extend(fused_problems(spec, located))
    if not problems:  # the graph is sound: fold the fused nodes into their hosts (fusion.py)
        problems.extend(fuse(spec, classes, located))
    if problems:
        raise GraphError(problems)
    return classes


def _service_problems(spec: GraphSpec, classes: dict, located, problems: list) -> set[str]:
    """Check `services:`; returns the names of the nodes that serve requests."""
    import inspect

    servers = set()
    seen = set()
    for i, svc in enumerate(spec.services):
        loc = ("services", i)
        missing = [n for n in (svc.src, svc.dst) if n not in spec.nodes]
        for name in missing:
            problems.append(problem_at(located, loc, f"service {svc}: no node named {name!r}", f"nodes are {', '.join(spec.nodes)}"))
        if missing:
            continue
        if svc.src == svc.dst:
            problems.append(problem_at(located, loc, f"service {svc}: a node cannot serve itself", "name a client and a server"))
            continue
        serve = getattr(classes[svc.dst], "serve", None)
        if serve is None or not inspect.iscoroutinefunction(serve):
            problems.append(problem_at(located, loc, f"service {svc}: {svc.dst!r} ({spec.nodes[svc.dst].kind}) does not serve "
                               "requests (no `async def serve`)", "the server of a service must be a node such as `rollout`"))
            continue
        if (svc.src, svc.dst) in seen:
            problems.append(problem_at(located, loc, f"service {svc} is declared twice", "remove one of them"))
        seen.add((svc.src, svc.dst))
        servers.add(svc.dst)
    return servers


def _async_problems(classes: dict, spec: GraphSpec, located) -> list[Problem]:
    """Hooks the runtime awaits must be `async def`: a plain `def` would fail deep in the worker."""
    import inspect

    from flowrl.node import Join

    out = []
    for name, cls in classes.items():
        if is_source(cls):
            hooks = ["generate"]
        elif issubclass(cls, Join):
            hooks = ["join"]
        elif is_observer(cls):
            hooks = ["observe"]
        else:
            hooks = ["process"]
        for hook in hooks + ["setup", "teardown"]:
            fn = getattr(cls, hook, None)
            if fn is not None and not inspect.iscoroutinefunction(fn):
                out.append(problem_at(located, ("nodes", name, "kind"),
                              f"{cls.__module__}.{cls.__qualname__}.{hook} is not async",
                              f"write `async def {hook}(self, ...)`: the runtime awaits it"))
    return out


def node_config(spec: GraphSpec, name: str, cls: type):
    """The validated config object of node `name`."""
    return cls.Config.model_validate(spec.nodes[name].config)
