"""Load a graph file: YAML with line numbers, `key.path=value` overrides, typed validation.

    spec = load_graph("graphs/ppo.yaml", overrides=["schedule.steps=20"])

Every problem becomes a `Problem` with file, line, key path, value and fix, and all of them are
raised together as one `GraphError`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from pydantic import ValidationError

from flowrl.graph.errors import GraphError, Problem, shown
from flowrl.graph.reading import Loc, Located, decode, parse_yaml
from flowrl.graph.spec import GraphSpec
from flowrl.graph.validation import problems_from_validation

__all__ = ["Located", "apply_overrides", "dump_graph", "load_graph", "load_graph_text", "parse_yaml"]


def _dotted(loc: Loc) -> str:
    return ".".join(str(p)[:60] for p in loc)


def apply_overrides(located: Located, overrides: list[str]) -> None:
    """Apply `key.path=value` overrides in place; the value is parsed as YAML (`3`, `true`, `[1,2]`)."""
    for item in overrides:
        where = f"override {item!r}"
        if "=" not in item:
            raise GraphError([Problem(item, "override has no '='", "write key.path=value, e.g. schedule.steps=20", where)])
        path, _, raw = item.partition("=")
        keys = [int(k) if k.isascii() and k.isdigit() else k for k in path.strip().split(".")]
        try:
            value = None if raw.strip() in ("", "~", "null", "Null", "NULL") else parse_yaml(raw, where).data
        except GraphError:
            value = raw
        cur = located.data
        shared = keys[0] == "vars"  # `vars.x=...` changes every alias of the anchor; other paths only their own copy
        for i, key in enumerate(keys[:-1]):
            nxt = cur.get(key) if isinstance(cur, dict) else (cur[key] if isinstance(cur, list) and isinstance(key, int) and key < len(cur) else None)
            if nxt is None and isinstance(cur, dict):
                nxt = cur[key] = {}
            if not isinstance(nxt, (dict, list)):
                raise GraphError([Problem(_dotted(keys[: i + 1]), f"cannot descend into {shown(nxt)}",
                                          "override a key that exists in the graph file", where)])
            if not shared:
                nxt = cur[key] = copy.copy(nxt)
            cur = nxt
        last = keys[-1]
        if isinstance(cur, list):
            if not isinstance(last, int) or last >= len(cur):
                raise GraphError([Problem(path, f"index {last!r} is not in a list of {len(cur)}", "use an existing index", where)])
        cur[last] = value
        located.lines[tuple(keys)] = None  # type: ignore[assignment]
        located.overrides = getattr(located, "overrides", {}) | {tuple(keys): item}


def load_graph(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, check: bool = True) -> GraphSpec:
    """Read, override, validate and structurally check a graph file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise GraphError([Problem("", f"cannot read graph file: {e.strerror or e}", "check the path", str(path))]) from None
    return load_graph_text(decode(data, str(path)), str(path), overrides, check=check)


def load_graph_text(text: str, file: str | None = None, overrides=(), *, check: bool = True) -> GraphSpec:
    located = parse_yaml(text, file)
    if not isinstance(located.data, dict):
        raise GraphError([Problem("", f"a graph file is a mapping with `nodes:`, got {type(located.data).__name__}",
                                  "start from graphs/ppo.yaml", file, 1)])
    apply_overrides(located, list(overrides))
    try:
        spec = GraphSpec.model_validate(located.data)
    except ValidationError as e:
        raise GraphError(problems_from_validation(e, located, GraphSpec)) from None
    spec.__dict__["_located"] = located  # kept for structural problems' line numbers
    if check:
        from flowrl.graph.structure import check_structure

        check_structure(spec, located)
    return spec


def dump_graph(spec: GraphSpec) -> str:
    """The resolved graph as YAML (what `RUN_DIR/graph.yaml` holds); loads back to an equal spec."""
    data = spec.model_dump(mode="json", exclude_defaults=False)
    data["edges"] = [
        {"from": e.src + (f".{e.src_port}" if e.src_port else ""), "to": e.dst + (f".{e.dst_port}" if e.dst_port else ""),
         "capacity": e.capacity, "capacity_bytes": e.capacity_bytes} for e in spec.edges
    ]
    data["weights"] = [str(w) for w in spec.weights]
    return yaml.safe_dump(data, sort_keys=False)
