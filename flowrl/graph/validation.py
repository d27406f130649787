"""Pydantic's validation errors as graph problems: the key, what was wrong, how to fix it, and the
line of the graph file (or the override) that said it."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ValidationError

from flowrl.graph.errors import Problem, shown
from flowrl.graph.reading import Loc, Located


def _dotted(loc: Loc) -> str:
    return ".".join(str(p)[:60] for p in loc)


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
    return "see the graph file reference in docs/graph.md"


def _allowed_keys(model: type[BaseModel], loc: Loc) -> list[str]:
    """The field names of the model that sits at `loc` (for 'did you mean' hints)."""
    from flowrl.graph import spec as s

    at = {(): s.GraphSpec, ("schedule",): s.ScheduleSpec, ("supervision",): s.SupervisionSpec,
          ("launcher",): s.LauncherSpec, ("metrics",): s.MetricsSpec, ("controller",): s.ControllerSpec,
          ("controller", "tickets"): s.TicketDeskSpec, ("controller", "weight_sync"): s.WeightSyncSpec,
          ("controller", "recovery"): s.RecoverySpec}
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
        got = "" if err["type"] == "missing" else f" (got {shown(value)})" if not isinstance(value, (dict, list)) else ""
        msg = err["msg"].removeprefix("Value error, ") + got
        file = located.file
        for oloc, item in overrides.items():
            if tuple(loc[: len(oloc)]) == oloc:
                file = f"override {item!r}"
        out.append(Problem(_dotted(loc), msg, _fix_for(dict(err, loc=loc), _allowed_keys(model, loc)),
                           file, located.line_of(loc) if not file or not file.startswith("override") else None))
    return out
