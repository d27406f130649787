"""Inventory file errors, reported like graph file errors: file, line, key path, value, fix.

`InventoryError` is a `GraphError`, so every caller that turns a bad graph into exit code 2 and a
clean message (`flowrl check`, `flowrl run`) treats a bad inventory the same way.
"""

from __future__ import annotations

import difflib
import typing

from pydantic import BaseModel, ValidationError

from flowrl.graph.errors import GraphError, Problem, problems_text, shown
from flowrl.graph.reading import Located


class InventoryError(GraphError):
    """An inventory file that cannot be used. Holds every problem found."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems)
        n = len(self.problems)
        head = f"inventory has {n} problem{'s' if n != 1 else ''}:"
        self.args = (problems_text(head, self.problems),)


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class that owns the keys at `loc` (walking fields, list items and optionals)."""
    for key in loc:
        if isinstance(key, int):
            continue
        field = model.model_fields.get(key)
        if field is None:
            return None
        found = None
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                found = t
                break
            stack.extend(typing.get_args(t))
        if found is None:
            return None
        model = found
    return model


def problems_from(e: ValidationError, located: Located, model: type[BaseModel]) -> list[Problem]:
    """Pydantic errors -> Problems with the line of each key and a fix naming the allowed keys."""
    out: list[Problem] = []
    for err in e.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and (p.startswith("function-") or "[" in p
                                                                            or p in ("int", "str", "float", "bool"))))
        value = err.get("input")
        got = "" if err["type"] == "missing" or isinstance(value, (dict, list)) else f" (got {shown(value)})"
        owner = _model_at(model, loc[:-1])
        allowed = list(owner.model_fields) if owner else []
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            fix = (f"did you mean `{close[0]}`? " if close else "remove it; ") + f"allowed keys here: {', '.join(allowed)}"
        elif err["type"] == "missing":
            fix = f"add `{loc[-1]}:`"
        else:
            ctx = err.get("ctx") or {}
            bound = next((f"use a value {w} {ctx[b]}" for b, w in (("ge", ">="), ("gt", ">")) if b in ctx), None)
            if "min_length" in ctx:
                bound = f"give at least {ctx['min_length']} entry"
            fix = bound or "see the inventory file format in docs/placement.md"
        if any(p.path == ".".join(map(str, loc)) for p in out):
            continue  # a union reports each branch; the first says enough
        out.append(Problem(".".join(map(str, loc)), err["msg"].removeprefix("Value error, ") + got, fix,
                           located.file, located.line_of(loc)))
    return out
