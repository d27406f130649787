"""Tools an agent's model may call: Python functions with a description, run with a deadline.

    >>> tools = Tools(["calc", "python", "mypkg.tools:search"], timeout_s=10)
    >>> tools.specs()              # for the chat template's ``tools=`` (OpenAI function format)  # doctest: +SKIP
    >>> msg = await tools.run(ToolCall("calc", {"expr": "417*382"}), call)                        # doctest: +SKIP
    >>> msg.content, msg.ok
    ('159294', True)                                                                             # doctest: +SKIP

A tool is a function, sync or ``async``, given as a callable or as ``"pkg.mod:fn"``; its
docstring's first paragraph is its description, and its parameters come from ``fn.parameters``
(a JSON schema) when it has one, else from its signature (``int``/``float``/``bool`` annotations
become those JSON types, anything else a string). Built-ins: ``calc`` (arithmetic through
``ast``: numbers, ``+ - * / // % **`` and parentheses, nothing else is evaluated) and
``python`` (code run by ``flowrl.rewards.sandbox.run_sandboxed``: no network, bounded CPU, memory,
processes and wall time -- a hanging program is killed by the sandbox).

What a call can end as -- each becomes a ``tool`` message the model sees, and the episode goes
on (``Trajectory.finish`` is never ``tool_error`` because of one bad call; the count of failed
calls is ``ToolResult.ok == False``, summed into ``Trajectory.info["tool_errors"]``):

- ``ok``: the function's return value (``str(...)``, JSON for dicts and lists);
- an error: the function raised (``error: ValueError: ...``), the tool is unknown, the call did
  not parse (a bad JSON block, see ``flowrl.agents.chat``);
- a timeout: no answer within ``timeout_s`` (``error: tool calc timed out after 10s``). An
  ``async`` tool is cancelled; a sync one runs in a thread of its own (``flowrl.agents.threads``:
  a hung call holds no pool the other episodes need), which cannot be stopped and finishes in the
  background (give long-running work to the ``python`` tool: its sandbox kills).

The journal. A re-issued ticket (a crash replays it with ``attempt + 1``) re-runs its episodes,
so a tool with effects outside the episode (a write, a purchase, an email) would act twice. A
function that declares a parameter named ``call`` gets a :class:`ToolContext`: who is calling
(ticket ``batch_id``, ``attempt``, ``episode`` index in the ticket, model ``turn``, ``index`` of
the call in the turn) and the node's :class:`ToolJournal`, which remembers every call and its
result under that key. ``call.previous()`` returns what earlier attempts of the same call (same
ticket, episode, turn and index) recorded, so the tool can return the recorded result instead of
acting again::

    def send_email(to: str, body: str, call) -> str:
        for done in call.previous():
            return done["result"]          # a replay: the email went out already
        return mail.send(to, body)

Keys are positions, not contents: a replay that samples a different turn still finds the same
key, and the tool decides (e.g. compare ``done["arguments"]``). The journal is in memory, and
also appended to a JSON-lines file when given a path (the agent node keeps one per node in its
run directory, so a restarted process still finds its earlier attempts).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import math
import operator
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.agents.base import ToolCall
from flowrl.agents.threads import in_thread


@dataclass
class ToolResult:
    """What a call gave: the tool message's text, and whether it succeeded."""

    content: str
    ok: bool = True
    seconds: float = 0.0

    def message(self, call: ToolCall) -> dict[str, Any]:
        msg = {"role": "tool", "content": self.content, "name": call.name}
        if call.id:
            msg["tool_call_id"] = call.id
        return msg


class ToolJournal:
    """Every tool call under its (batch_id, attempt, episode, turn, index) key, with its result."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._entries: dict[tuple, dict[str, Any]] = {}
        self._read = 0
        self._load()

    def _load(self) -> None:
        """Entries other processes (replicas, an earlier life of this one) appended since the last read."""
        if self.path is None or not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._read)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._read += end
        for line in data[:end].decode(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a torn line of a crashed writer
            self._entries[tuple(e["key"])] = e

    def record(self, key: tuple, name: str, arguments: dict[str, Any], result: str, ok: bool) -> None:
        entry = {"key": list(key), "name": name, "arguments": arguments, "result": result, "ok": ok}
        with self._lock:
            self._entries[tuple(key)] = entry
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:  # one short append: whole lines from concurrent writers
                    f.write(json.dumps(entry, default=str) + "\n")

    def previous(self, batch_id: str, attempt: int, episode: int, turn: int, index: int) -> list[dict[str, Any]]:
        """Entries of earlier attempts of this call, oldest first (the file is read again first: a
        replay may run in another replica than the attempt before it)."""
        with self._lock:
            self._load()
            found = [e for k, e in self._entries.items()
                     if k[0] == batch_id and k[2:] == (episode, turn, index) and k[1] < attempt]
        return sorted(found, key=lambda e: e["key"][1])

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class ToolContext:
    """Given to a tool function that declares a ``call`` parameter (see the module docstring)."""

    batch_id: str = ""
    attempt: int = 0
    episode: int = 0
    turn: int = 0
    index: int = 0
    journal: ToolJournal = field(default_factory=ToolJournal)

    @property
    def key(self) -> tuple[str, int, int, int, int]:
        return (self.batch_id, self.attempt, self.episode, self.turn, self.index)

    def previous(self) -> list[dict[str, Any]]:
        """What earlier attempts of this very call recorded (empty: not a replay)."""
        return self.journal.previous(*self.key)

    @classmethod
    def for_session(cls, session: str, turn: int, journal: ToolJournal, index: int = 0) -> "ToolContext":
        """From the agent node's session id ``"<batch_id>:<attempt>:<episode>"``."""
        batch, _, rest = session.rpartition(":")
        batch, _, attempt = batch.rpartition(":")
        try:
            return cls(batch, int(attempt), int(rest), turn, index, journal)
        except ValueError:
            return cls(session, 0, 0, turn, index, journal)


@dataclass
class Tool:
    """One tool: the function, how it is described to the model, its deadline."""

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    """None: the registry's ``timeout_s``."""

    @classmethod
    def of(cls, fn: Callable[..., Any], name: str | None = None) -> "Tool":
        doc = inspect.getdoc(fn) or ""
        params = getattr(fn, "parameters", None) or _schema(fn)
        return cls(name or getattr(fn, "tool_name", None) or fn.__name__, fn, doc.split("\n\n")[0].strip(), params,
                   getattr(fn, "timeout_s", None))

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def wants_call(self) -> bool:
        return "call" in inspect.signature(self.fn).parameters


def _schema(fn: Callable[..., Any]) -> dict[str, Any]:
    kinds = {int: "integer", float: "number", bool: "boolean", "int": "integer", "float": "number", "bool": "boolean"}
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("call", "self") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = {"type": kinds.get(p.annotation, "string")}
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "object", "properties": props, "required": required}


class Tools:
    """A registry of tools by name; ``run`` executes one call with its deadline."""

    def __init__(self, tools: Iterable[str | Callable[..., Any] | Tool] = (), *, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self.tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, tool: str | Callable[..., Any] | Tool) -> Tool:
        if isinstance(tool, str):
            tool = Tool.of(resolve_tool(tool))
        elif not isinstance(tool, Tool):
            tool = Tool.of(tool)
        self.tools[tool.name] = tool
        return tool

    def __bool__(self) -> bool:
        return bool(self.tools)

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools.values()]

    async def run(self, call: ToolCall, ctx: ToolContext | None = None) -> ToolResult:
        """Run ``call``; never raises (an error is the result's text, ``ok=False``)."""
        import time

        t0 = time.perf_counter()
        result = await self._run(call, ctx or ToolContext())
        result.seconds = time.perf_counter() - t0
        if ctx is not None:
            ctx.journal.record(ctx.key, call.name, call.arguments, result.content, result.ok)
        return result

    async def _run(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        if not call.name:
            return ToolResult(f"error: {call.arguments.get('error', 'the tool call did not parse')}", ok=False)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"error: no tool named {call.name!r}; tools: {', '.join(self.tools) or 'none'}",
                              ok=False)
        kwargs = dict(call.arguments)
        if tool.wants_call:
            kwargs["call"] = ctx
        timeout = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        try:
            if inspect.iscoroutinefunction(tool.fn):
                out = await asyncio.wait_for(tool.fn(**kwargs), timeout)
            else:
                out = await asyncio.wait_for(in_thread(tool.fn, **kwargs), timeout)
        except asyncio.TimeoutError:
            return ToolResult(f"error: tool {tool.name} timed out after {timeout:g}s", ok=False)
        except Exception as e:  # noqa: BLE001 - the model sees the error, the episode goes on
            return ToolResult(f"error: {type(e).__name__}: {e}", ok=False)
        if isinstance(out, ToolResult):
            return out
        return ToolResult(out if isinstance(out, str) else json.dumps(out, default=str))


def resolve_named(name: str, builtins: dict[str, Any], what: str, shape: str) -> Any:
    """A built-in's name, or ``"pkg.mod:attr"`` imported (``what``: tool / env; ``shape``: function / class)."""
    if name in builtins:
        return builtins[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"{what} {name!r}: give a built-in {what} ({', '.join(builtins)}) or a {shape} "
                         f"as 'package.module:{shape}'")
    found = getattr(importlib.import_module(module), attr, None)
    if found is None or not callable(found):
        raise ValueError(f"{what} {name!r}: module {module!r} has no {shape} {attr!r}")
    return found


def resolve_tool(name: str) -> Callable[..., Any]:
    """A built-in tool's name (``calc``, ``python``) or ``"pkg.mod:fn"``."""
    return resolve_named(name, BUILTIN_TOOLS, "tool", "function")


# --- built-in tools ------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_POW = 100
"""Largest exponent ``calc`` takes (``9**9**9`` would hang the process)."""


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Nothing but arithmetic is evaluated (the expression is parsed with ``ast``; names, calls and
    attributes are refused)."""
    if len(expr) > 200:
        raise ValueError(f"expression of {len(expr)} characters; at most 200")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expr!r}") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > MAX_POW or abs(a) > 1e6):
            raise ValueError(f"power {a}**{b} too large (exponent at most {MAX_POW})")
        if isinstance(a, int) and isinstance(b, int) and max(abs(a), abs(b)) > 10**100:
            raise ValueError("numbers too large")
        value = _BINARY[type(node.op)](a, b)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("the result is not finite")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def python(code: str, stdin: str = "") -> ToolResult:
    """Run Python code in a sandbox (no network, bounded time and memory) and return its output.

    Print what you want to see; the output is stdout, or the status and the end of stderr."""
    from flowrl.rewards.sandbox import run_sandboxed

    r = run_sandboxed(code, stdin=stdin, limits=python.limits)
    if r.status == "ok":
        return ToolResult(r.stdout[-4000:])
    return ToolResult(f"error ({r.status}): {(r.stderr or r.stdout)[-2000:]}", ok=False)


def _python_limits():
    from flowrl.rewards.sandbox import Limits

    return Limits(cpu_s=5.0, wall_s=10.0)


python.limits = _python_limits()  # type: ignore[attr-defined]  # the sandbox's limits; tests lower them
python.timeout_s = 30.0  # type: ignore[attr-defined]  # the sandbox kills first (wall_s)

BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calc": calc, "python": python}
