"""Tools: safe arithmetic, the sandboxed python tool, deadlines, errors as messages, the journal."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

from flowrl.agents.base import ToolCall
from flowrl.agents.tools import Tool, ToolContext, ToolJournal, Tools, calc, python


@pytest.mark.parametrize("expr,want", [("417*382", "159294"), ("(2+3)*-4", "-20"), ("7/2", "3.5"), ("8/2", "4"),
                                       ("2**10", "1024"), ("17//5", "3"), ("17%5", "2")])
def test_calc_evaluates_arithmetic(expr, want):
    assert calc(expr) == want


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "open('x')", "(1).real", "a+1",
                                  "[1]*3", "9**9**9", "lambda: 1", "1 if 1 else 2", "'a'*3"])
def test_calc_refuses_anything_but_arithmetic(expr):
    with pytest.raises(ValueError):
        calc(expr)


def run(tools, call, ctx=None):
    return anyio.run(tools.run, call, ctx)


def test_a_call_gives_a_tool_message_and_errors_are_messages_too():
    tools = Tools(["calc"])
    ok = run(tools, ToolCall("calc", {"expr": "6*7"}, "c1"))
    assert (ok.content, ok.ok) == ("42", True)
    assert ok.message(ToolCall("calc", {}, "c1")) == {"role": "tool", "content": "42", "name": "calc",
                                                      "tool_call_id": "c1"}
    bad = run(tools, ToolCall("calc", {"expr": "x"}))
    assert not bad.ok and bad.content.startswith("error: ValueError")
    unknown = run(tools, ToolCall("search", {"q": "x"}))
    assert not unknown.ok and "no tool named 'search'" in unknown.content and "calc" in unknown.content
    unparsed = run(tools, ToolCall("", {"error": "bad tool call: Expecting value"}))
    assert not unparsed.ok and "Expecting value" in unparsed.content
    wrong_args = run(tools, ToolCall("calc", {"expression": "1"}))
    assert not wrong_args.ok and "TypeError" in wrong_args.content


def test_specs_come_from_docstrings_and_signatures():
    def lookup(key: str, limit: int = 3) -> str:
        """Look a key up.

        More text the model does not need."""
        return key

    lookup.timeout_s = 2
    tools = Tools([lookup, "calc"])
    spec = tools.specs()[0]["function"]
    assert spec["name"] == "lookup" and spec["description"] == "Look a key up."
    assert spec["parameters"] == {"type": "object", "properties": {"key": {"type": "string"},
                                                                   "limit": {"type": "integer"}}, "required": ["key"]}
    assert tools.tools["lookup"].timeout_s == 2
    assert Tools(["flowrl.agents.tools:calc"]).tools["calc"].fn is calc
    with pytest.raises(ValueError, match="package.module:function"):
        Tools(["nope"])


@pytest.mark.timeout(20)
def test_a_hanging_tool_times_out_into_an_error_message_sync_or_async():
    release = threading.Event()

    def stuck(x: str) -> str:
        release.wait(10)
        return x

    async def stuck_async(x: str) -> str:
        await asyncio.Event().wait()

    tools = Tools([stuck, stuck_async], timeout_s=0.2)

    async def both():
        try:
            return [await tools.run(ToolCall(name, {"x": "1"})) for name in ("stuck", "stuck_async")]
        finally:
            release.set()  # before the loop closes: it waits for its worker threads

    for name, out in zip(("stuck", "stuck_async"), anyio.run(both)):
        assert not out.ok and out.content == f"error: tool {name} timed out after 0.2s"


@pytest.mark.timeout(30)
def test_hung_sync_tools_do_not_hold_up_the_other_calls():
    release = threading.Event()

    def stuck(x: str) -> str:
        release.wait(20)
        return x

    def quick(x: str) -> str:
        return x + "!"

    tools = Tools([stuck, quick], timeout_s=5.0)

    async def many():
        try:
            hung = [asyncio.create_task(tools.run(ToolCall("stuck", {"x": "1"}))) for _ in range(32)]
            await asyncio.sleep(0)  # every stuck call has its thread before the quick one asks
            out = await asyncio.wait_for(tools.run(ToolCall("quick", {"x": "a"})), 2.0)  # a pool of cores + 4 would be full
            for t in hung:
                t.cancel()
            return out
        finally:
            release.set()

    out = anyio.run(many)
    assert out.ok and out.content == "a!"


@pytest.mark.timeout(60)
def test_the_python_tool_runs_in_the_sandbox_and_a_hang_is_killed_by_its_limits(monkeypatch):
    from flowrl.rewards.sandbox import Limits

    tools = Tools(["python"])
    monkeypatch.setattr(python, "limits", Limits(cpu_s=5, wall_s=10))  # ample (the tool's own): these must finish
    out = run(tools, ToolCall("python", {"code": "print(sum(range(10)))"}))
    assert (out.content, out.ok) == ("45\n", True)
    net = run(tools, ToolCall("python", {"code": "import socket; socket.socket().connect(('1.1.1.1', 80))"}))
    assert not net.ok
    monkeypatch.setattr(python, "limits", Limits(cpu_s=1, wall_s=2))  # low only where it must hang
    hang = run(tools, ToolCall("python", {"code": "while True: pass"}))
    assert not hang.ok and hang.content.startswith("error (") and hang.seconds < 10


def test_the_journal_lets_a_tool_tell_a_replay_apart(tmp_path):
    sent = []

    def send(to: str, call) -> str:
        for done in call.previous():
            return "already sent: " + done["result"]
        sent.append(to)
        return f"sent #{len(sent)}"

    path = tmp_path / "journal.jsonl"
    tools = Tools([send])
    first = ToolContext.for_session("b7:0:3", turn=1, journal=ToolJournal(path))
    assert first.key == ("b7", 0, 3, 1, 0)
    assert run(tools, ToolCall("send", {"to": "a"}), first).content == "sent #1"
    # the ticket is re-issued (attempt 1) to a restarted process: the journal file still knows the call
    replay = ToolContext.for_session("b7:1:3", turn=1, journal=ToolJournal(path))
    assert run(tools, ToolCall("send", {"to": "a"}), replay).content == "already sent: sent #1"
    other = ToolContext.for_session("b7:1:4", turn=1, journal=replay.journal)  # another episode: not a replay
    assert run(tools, ToolCall("send", {"to": "b"}), other).content == "sent #2"
    assert sent == ["a", "b"] and len(ToolJournal(path)) == 3
    # another replica's journal, opened before the first attempt ran, still sees it on a replay
    early = ToolJournal(tmp_path / "j2.jsonl")
    first = ToolContext.for_session("b9:0:0", turn=0, journal=ToolJournal(tmp_path / "j2.jsonl"))
    run(tools, ToolCall("send", {"to": "c"}), first)
    replay = ToolContext.for_session("b9:1:0", turn=0, journal=early)
    assert run(tools, ToolCall("send", {"to": "c"}), replay).content == "already sent: sent #3"
