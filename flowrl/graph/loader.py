"""Load a graph file: YAML with line numbers, `key.path=value` overrides, typed validation.

    spec = load_graph("graphs/ppo.yaml", overrides=["schedule.steps=20"])

Every problem becomes a `Problem` with file, line, key path, value and fix, and all of them are
raised together as one `GraphError`.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from flowrl.graph.errors import GraphError, Problem
from flowrl.graph.spec import GraphSpec

Loc = tuple  # key path as a tuple of str / int


class Located:
    """Plain Python data from YAML plus the line of every key path."""

    def __init__(self, data: Any, lines: dict[Loc, int], file: str | None):
        self.data, self.lines, self.file = data, lines, file

    def line_of(self, loc: Loc) -> int | None:
        loc = tuple(loc)
        while loc:  # nearest enclosing key that has a line
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get(())


def _construct(node: yaml.Node, loc: Loc, lines: dict, problems: list, file: str | None, memo: dict | None = None):
    """YAML node -> Python data. An anchor and its aliases become one shared object, so an
    override of `vars.model.d_model` reaches every node that says `model: *model`."""
    memo = {} if memo is None else memo
    lines.setdefault(loc, node.start_mark.line + 1)
    if id(node) in memo and isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        _record_lines(memo[id(node)][1], loc, lines)
        return memo[id(node)][0]
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            key = yaml.safe_load(yaml.serialize(key_node)) if not isinstance(key_node, yaml.ScalarNode) else key_node.value
            if key_node.tag.endswith(":int"):
                key = int(key)
            if key in out:
                problems.append(Problem(_dotted(loc + (key,)), f"key {key!r} appears twice (duplicate name)",
                                        "give every key (and every node) a unique name", file,
                                        key_node.start_mark.line + 1))
            lines[loc + (key,)] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, loc + (key,), lines, problems, file, memo)
        memo[id(node)] = (out, {k[len(loc):]: v for k, v in lines.items() if k[:len(loc)] == loc})
        return out
    if isinstance(node, yaml.SequenceNode):
        out = [_construct(v, loc + (i,), lines, problems, file, memo) for i, v in enumerate(node.value)]
        memo[id(node)] = (out, {k[len(loc):]: v for k, v in lines.items() if k[:len(loc)] == loc})
        return out
    return yaml.SafeLoader(yaml.serialize(node)).get_single_data() if node.tag != "tag:yaml.org,2002:str" else node.value


def _record_lines(relative: dict, loc: Loc, lines: dict) -> None:
    for sub, line in relative.items():
        lines.setdefault(loc + sub, line)


def _dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc)


def parse_yaml(text: str, file: str | None = None) -> Located:
    """Parse YAML text keeping the line of every key. Raises GraphError on syntax errors."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise GraphError([Problem("", f"not valid YAML: {getattr(e, 'problem', e)}",
                                  "fix the YAML syntax at that line", file,
                                  mark.line + 1 if mark else None)]) from None
    lines: dict[Loc, int] = {}
    problems: list[Problem] = []
    data = {} if root is None else _construct(root, (), lines, problems, file)
    if problems:
        raise GraphError(problems)
    return Located(data, lines, file)


def apply_overrides(located: Located, overrides: list[str]) -> None:
    """Apply `key.path=value` overrides in place; the value is parsed as YAML (`3`, `true`, `[1,2]`)."""
    for item in overrides:
        where = f"override {item!r}"
        if "=" not in item:
            raise GraphError([Problem(item, "override has no '='", "write key.path=value, e.g. schedule.steps=20", where)])
        path, _, raw = item.partition("=")
        keys = [int(k) if k.isdigit() else k for k in path.strip().split(".")]
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        cur = located.data
        shared = keys[0] == "vars"  # `vars.x=...` changes every alias of the anchor; other paths only their own copy
        for i, key in enumerate(keys[:-1]):
            nxt = cur.get(key) if isinstance(cur, dict) else (cur[key] if isinstance(cur, list) and isinstance(key, int) and key < len(cur) else None)
            if nxt is None and isinstance(cur, dict):
                nxt = cur[key] = {}
            if not isinstance(nxt, (dict, list)):
                raise GraphError([Problem(_dotted(keys[: i + 1]), f"cannot descend into {nxt!r}",
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


def _fix_for(err: dict, model_fields: list[str]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        key = str(err["loc"][-1])
        close = difflib.get_close_matches(key, model_fields, n=1)
        if close:
            return f"did you mean `{close[0]}`? Allowed keys here: {', '.join(model_fields)}"
        return f"remove it; allowed keys here: {', '.join(model_fields)}"
    if kind == "missing":
        return f"add `{err['loc'][-1]}:`"
    ctx = err.get("ctx", {})
    for bound, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if bound in ctx:
            return f"use a value {word} {ctx[bound]}"
    if kind.startswith("literal_error"):
        return f"use one of {err.get('ctx', {}).get('expected', 'the allowed values')}"
    return "see the graph file reference in README.md"


def _allowed_keys(model: type[BaseModel], loc: Loc) -> list[str]:
    """The field names of the model that sits at `loc` (for 'did you mean' hints)."""
    from flowrl.graph import spec as s

    at = {(): GraphSpec, ("schedule",): s.ScheduleSpec, ("supervision",): s.SupervisionSpec,
          ("launcher",): s.LauncherSpec}
    parent = tuple(loc[:-1])
    if parent in at:
        return list(at[parent].model_fields)
    if len(parent) == 2 and parent[0] == "nodes":
        return list(s.NodeSpec.model_fields)
    if len(parent) == 3 and parent[0] == "nodes" and parent[2] == "on_failure":
        return list(s.FailurePolicy.model_fields)
    if len(parent) == 2 and parent[0] in ("edges",):
        return ["from", "to", "capacity", "capacity_bytes"]
    return list(model.model_fields)


def problems_from_validation(e: ValidationError, located: Located, model: type[BaseModel],
                             prefix: Loc = ()) -> list[Problem]:
    out = []
    overrides = getattr(located, "overrides", {})
    for err in e.errors():
        # pydantic adds the union member / validator name to loc; keep only real keys
        loc = prefix + tuple(p for p in err["loc"] if not (isinstance(p, str) and (p.startswith("function-") or p in ("int", "list[union[int,str]]", "literal['auto']", "str"))))
        value = err.get("input")
        shown = "" if err["type"] == "missing" else f" (got {value!r})" if not isinstance(value, (dict, list)) else ""
        msg = err["msg"].removeprefix("Value error, ") + shown
        file = located.file
        for oloc, item in overrides.items():
            if tuple(loc[: len(oloc)]) == oloc:
                file = f"override {item!r}"
        out.append(Problem(_dotted(loc), msg, _fix_for(dict(err, loc=loc), _allowed_keys(model, loc)),
                           file, located.line_of(loc) if not file or not file.startswith("override") else None))
    return out


def load_graph(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, check: bool = True) -> GraphSpec:
    """Read, override, validate and structurally check a graph file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise GraphError([Problem("", f"cannot read graph file: {e.strerror}", "check the path", str(path))]) from None
    return load_graph_text(text, str(path), overrides, check=check)


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
