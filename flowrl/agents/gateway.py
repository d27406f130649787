"""An OpenAI-compatible gateway on loopback: plain agent code talks to the rollout through it, and
every token of its episode is kept exactly as the engine and the chat format made it.

    gw = Gateway()
    await gw.start()                                         # 127.0.0.1, a free port, this loop
    base_url, key = gw.open_session("t3-0-1", gen, fmt, min_version=7, seed=123,
                                    max_new_tokens=256, max_tokens=4096, max_turns=8)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    r = await client.chat.completions.create(model="policy", messages=msgs, tools=tools)
    r.choices[0].message.tool_calls                           # parsed from the model's <tool_call> blocks
    traj = gw.close_session("t3-0-1")                         # Trajectory: token-exact, mask on model tokens
    await gw.stop()

**URLs and keys.** One gateway serves a process (``flowrl.agents.openai_agent`` starts it lazily on
the agent node's loop). Each session (episode) gets its own ``base_url``,
``http://127.0.0.1:PORT/s/<slug>/v1`` with a random slug, and its own bearer key
(``Authorization: Bearer <key>``, compared with :func:`hmac.compare_digest`). A missing or wrong
key is answered 401 (counted in :meth:`Gateway.stats`) before the body is read; the model never
sees the request. An unknown or closed slug is 404. Bodies over ``max_body_bytes`` are 413.

**Endpoints** (under the session's ``base_url``): ``POST /chat/completions`` (``messages``,
``tools``; ``tool_choice`` is accepted and ignored: the model decides), ``POST /completions``
(``prompt`` as a string, which needs a chat format with ``encode``, or as a list of token ids),
``GET /models``. ``max_tokens`` / ``max_completion_tokens`` can only lower the session's
``max_new_tokens``. ``temperature``, ``top_p``, ``seed``, ``stop`` and the like are accepted and ignored:
sampling is the rollout's (the trainer reads it from the batch), and the draws are seeded by the
session's seed and the call's index. ``n`` must be 1 and ``stream`` false (400 otherwise).
``model`` is ignored. Log-probs and versions are never returned: they go to the trajectory.

**Token reuse.** A session keeps its conversation as *chains* of token ids, each with the
messages it stands for. A chat call whose messages repeat a chain's conversation so far -- the
assistant messages being the ones the gateway returned, compared by content and tool calls
(names and JSON arguments, not ids) -- continues that chain: the earlier ids are reused exactly
(first prompt, the engine's tokens, the environment ids made before), and only the new messages
are formatted, with ``fmt.extend(new_messages)``. A call that repeats a *prefix* of a chain (a
retry, or new messages after an earlier turn), or that continues a chain another call of the
session continued meanwhile (concurrent calls), forks a copy of that prefix: still token-exact.
Any other call (edited history, other tools) starts a new chain with ``fmt.start(messages, tools)``, counted as ``diverged``: its earlier assistant turns are
re-rendered from text, so only the new chain's own model turns are exact. After a turn cut by
``length`` (no stop token), the chain gets ``fmt.stop_ids[0]`` as an environment token before the
next messages, so the turn is closed the way the template expects.

Formatting (``fmt.start`` / ``fmt.extend``) runs on the loop: it is a chat template over the new
messages only, except on a diverged call.

``close_session`` returns the longest chain as a :class:`~flowrl.agents.base.Trajectory`:
segments ``prompt`` (the first ``fmt.start``), ``model`` (mask True, the engine's log-probs and
versions) and ``env`` (``fmt.extend`` ids, and token ids a ``/completions`` call added).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flowrl.agents.base import ChatFormat, Completion, Generator, ServiceError, ToolCall, Trajectory

_TOOL_BLOCK = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.S)
"""Hermes tool-call blocks (an unclosed one runs to the end): left out of the content."""


class RequestError(ValueError):
    """A request the gateway refuses: ``status`` (400 bad field, 404 unknown session ...),
    ``param`` (the field, when one is to blame) and an OpenAI error ``type``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code


def _error_body(err: RequestError) -> dict[str, Any]:
    return {"error": {"message": str(err), "type": err.type, "param": err.param, "code": err.code}}


# --- messages: what the gateway compares and what it hands the chat format --------------------------

def _text(content: Any, where: str) -> str:
    """A message's content as text (None: empty; a list of parts: their text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"{where}: only text content parts are supported, got {part!r:.80}",
                                   param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, f"{where} must be a string or a list of text parts, got {type(content).__name__}",
                       param=where)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as a value (OpenAI sends a JSON string; a template wants a dict)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def clean_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate ``messages`` and reduce each to what a chat template reads: ``role``, ``content``
    (text), and ``tool_calls`` (``{"id", "type", "function": {"name", "arguments": dict}}``),
    ``tool_call_id``, ``name`` where given."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(400, f"{where} needs a role of system, user, assistant or tool, got {m!r:.80}",
                               param=where)
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError(400, f"{where}.tool_calls[{j}] needs function.name", param=where)
                calls.append({"id": c.get("id", ""), "type": "function",
                              "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}))}})
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def message_key(msg: dict[str, Any]) -> str:
    """What makes two messages the same turn: role, content (an assistant's stripped) and tool calls
    (name and canonical JSON arguments); ids and names are left out."""
    content = msg["content"].strip() if msg["role"] == "assistant" else msg["content"]
    calls = [(c["function"]["name"], _canonical(c["function"]["arguments"])) for c in msg.get("tool_calls", ())]
    return _canonical([msg["role"], content, calls])


# --- a session's chains of token ids ----------------------------------------------------------------

@dataclass
class _Mark:
    """A point of a chain: its first ``n_tokens`` ids stand for its first ``n_messages`` messages.
    ``prompt``: ready to generate (ends with the generation prompt); ``turn``: ends with a model
    turn closed by a stop token; ``cut``: ends with a model turn that ran out of tokens."""

    n_messages: int
    n_tokens: int
    kind: str


@dataclass
class _Chain:
    """One conversation as token ids; ``messages`` is None once ``/completions`` added raw ids."""

    tools: str
    messages: list[str] | None = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[tuple[str, int]] = field(default_factory=list)
    marks: list[_Mark] = field(default_factory=list)
    calls: list[tuple[int, int]] = field(default_factory=list)
    """``(n_tokens at the end of a model turn, tool calls in it)`` per model turn."""

    def add(self, kind: str, ids: Sequence[int], out: Completion | None = None) -> None:
        if not ids:
            return
        self.tokens += ids
        self.mask += [out is not None] * len(ids)
        self.logprobs += list(out.logprobs) if out is not None else [0.0] * len(ids)
        self.versions += list(out.versions) if out is not None else [-1] * len(ids)
        if self.segments and self.segments[-1][0] == kind and kind != "model":
            self.segments[-1] = (kind, self.segments[-1][1] + len(ids))
        else:
            self.segments.append((kind, len(ids)))

    def fork(self, n_tokens: int) -> "_Chain":
        """A copy of the first ``n_tokens`` ids (a point between segments or inside an env one)."""
        new = _Chain(self.tools)
        marks = [m for m in self.marks if m.n_tokens <= n_tokens]
        new.messages = None if self.messages is None else self.messages[:marks[-1].n_messages if marks else 0]
        new.tokens, new.mask = self.tokens[:n_tokens], self.mask[:n_tokens]
        new.logprobs, new.versions = self.logprobs[:n_tokens], self.versions[:n_tokens]
        at = 0
        for kind, n in self.segments:
            if at >= n_tokens:
                break
            new.segments.append((kind, min(n, n_tokens - at)))
            at += n
        new.marks = [_Mark(m.n_messages, m.n_tokens, m.kind) for m in marks]
        new.calls = [c for c in self.calls if c[0] <= n_tokens]
        return new

    @property
    def turns(self) -> int:
        return len(self.calls)

    @property
    def tool_calls(self) -> int:
        return sum(n for _, n in self.calls)


@dataclass
class _Plan:
    """Where a call's prompt comes from: ``chain[:n_tokens]`` (None: nothing) + ``extra`` ids."""

    chain: _Chain | None
    n_tokens: int
    extra: list[int]
    extra_kind: str


@dataclass
class _Session:
    """One episode's state: its generator, chat format and limits, and the chains its calls built.
    A plain object: ``plan_*`` says where a call's prompt comes from (formatting only what is new),
    ``commit`` adds the model's turn; the server does the I/O in between."""

    name: str
    slug: str
    key: str
    gen: Generator
    fmt: ChatFormat
    min_version: int
    seed: int
    max_new_tokens: int
    max_tokens: int
    max_turns: int
    chains: list[_Chain] = field(default_factory=list)
    calls: int = 0
    diverged: int = 0
    forks: int = 0
    unauthorized: int = 0
    finish: str | None = None
    error: str | None = None
    inflight: set[asyncio.Task] = field(default_factory=set)
    sampled: dict[str, float] = field(default_factory=dict)  # what the turns were sampled at (the rollout's)

    def end(self, finish: str, error: str | None = None) -> None:
        """Record why the episode ended (the first reason stays)."""
        if self.finish is None:
            self.finish, self.error = finish, error

    def plan_chat(self, msgs: list[dict[str, Any]], keys: list[str], tools: list[dict] | None) -> _Plan:
        tools_key = _canonical(tools or [])
        best: tuple[_Chain, _Mark] | None = None
        for chain in reversed(self.chains):
            if chain.messages is None or chain.tools != tools_key:
                continue
            common = 0
            while common < min(len(keys), len(chain.messages)) and keys[common] == chain.messages[common]:
                common += 1
            for mark in reversed(chain.marks):
                fits = mark.n_messages == len(keys) if mark.kind == "prompt" else mark.n_messages < len(keys)
                if mark.n_messages <= common and fits:
                    if best is None or mark.n_tokens > best[1].n_tokens:
                        best = (chain, mark)
                    break
        if best is None:
            if self.chains:
                self.diverged += 1
            return _Plan(None, 0, list(self.fmt.start(msgs, tools)), "prompt")
        chain, mark = best
        extra: list[int] = []
        if mark.kind == "cut":
            extra.append(int(self.fmt.stop_ids[0]))
        if mark.kind != "prompt":
            extra += list(self.fmt.extend(msgs[mark.n_messages:]))
        return _Plan(chain, mark.n_tokens, extra, "env")

    def plan_ids(self, ids: list[int]) -> _Plan:
        best = None
        for chain in reversed(self.chains):
            n = len(chain.tokens)
            if n <= len(ids) and chain.tokens == ids[:n] and (best is None or n > len(best.tokens)):
                best = chain
        if best is None:
            if self.chains:
                self.diverged += 1
            return _Plan(None, 0, ids, "prompt")
        return _Plan(best, len(best.tokens), ids[len(best.tokens):], "env")

    def commit(self, plan: _Plan, out: Completion, keys: list[str] | None, answer_key: str | None,
               n_calls: int, tools: list[dict] | None) -> None:
        """Add the call's prompt ids and the model's turn to the chain it continued (in place when
        nothing was added to that chain meanwhile, else to a fork of it)."""
        chain = plan.chain
        if chain is None:
            chain = _Chain(_canonical(tools or []))
            self.chains.append(chain)
        elif len(chain.tokens) != plan.n_tokens:  # another call of the session continued it meanwhile
            chain = chain.fork(plan.n_tokens)
            self.chains.append(chain)
            self.forks += 1
        chain.add(plan.extra_kind, plan.extra)
        if keys is None or chain.messages is None:
            chain.messages = None
        else:
            chain.messages = list(keys)
            if plan.extra:
                chain.marks.append(_Mark(len(keys), len(chain.tokens), "prompt"))
        chain.add("model", out.tokens, out)
        chain.calls.append((len(chain.tokens), n_calls))
        if chain.messages is not None and answer_key is not None:
            chain.messages.append(answer_key)
            kind = "cut" if out.finish == "length" else "turn"
            chain.marks.append(_Mark(len(chain.messages), len(chain.tokens), kind))

    def trajectory(self) -> Trajectory:
        """The longest chain (the latest of equals) as the episode's trajectory."""
        info = {"chains": len(self.chains), "diverged": self.diverged, "forks": self.forks, "calls": self.calls,
                "unauthorized": self.unauthorized}
        if not self.chains:
            return Trajectory(finish=self.finish or "done", error=self.error, info=info)
        chain = max(reversed(self.chains), key=lambda c: len(c.tokens))
        return Trajectory(
            tokens=list(chain.tokens), mask=list(chain.mask), logprobs=list(chain.logprobs),
            versions=list(chain.versions), prompt_len=chain.segments[0][1], segments=list(chain.segments),
            turns=chain.turns, tool_calls=chain.tool_calls, finish=self.finish or "done", error=self.error, info=info,
        )


def call_seed(seed: int, call: int) -> int:
    """The draws of a session's ``call``-th model call: a pure function of the episode's seed and
    the call's index, so a replayed episode samples the same turns."""
    digest = hashlib.blake2b(f"{seed}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


# --- the server ------------------------------------------------------------------------------------

class Gateway:
    """The OpenAI-compatible server of one process (see the module docstring).

    ``request_timeout_s`` bounds each model call (the generator gets it as ``timeout_s``; past it
    the call is answered 504); ``max_body_bytes`` bounds a request body (413 past it)."""

    def __init__(self, *, request_timeout_s: float = 300.0, max_body_bytes: int = 8 << 20,
                 model_name: str = "flowrl-policy") -> None:
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.model_name = model_name
        self.root: str | None = None
        """``http://127.0.0.1:PORT`` once started."""
        self.address: tuple[str, int] | None = None
        self._sessions: dict[str, _Session] = {}
        self._slugs: dict[str, _Session] = {}
        self._runner: Any = None
        self._counts = {"requests": 0, "unauthorized": 0, "bad_requests": 0, "rollout_errors": 0,
                        "diverged": 0, "forks": 0}

    async def start(self) -> str:
        """Serve on 127.0.0.1 (only) on a free port, on the running loop; returns the root URL."""
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/s/{slug}/v1/chat/completions", self._chat)
        app.router.add_post("/s/{slug}/v1/completions", self._completions)
        app.router.add_get("/s/{slug}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.address = sock.getsockname()[:2]
        await web.SockSite(self._runner, sock).start()
        self.root = f"http://127.0.0.1:{self.address[1]}"
        return self.root

    async def stop(self) -> None:
        """Close every session's model calls and the server."""
        for s in list(self._sessions.values()):
            self._cancel(s)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, session: str, gen: Generator, fmt: ChatFormat, *, min_version: int = 0, seed: int = 0,
                     max_new_tokens: int = 512, max_tokens: int = 8192, max_turns: int = 1 << 30) -> tuple[str, str]:
        """Start an episode's session; returns its ``(base_url, api_key)``. ``max_new_tokens`` is a
        model turn's limit, ``max_tokens`` the whole trajectory's (past it: 400, finish
        ``token_budget``), ``max_turns`` the model calls' (past it: 400, finish ``max_turns``)."""
        if self.root is None:
            raise RuntimeError("Gateway.open_session before start(): await gateway.start() first")
        if session in self._sessions:
            raise ValueError(f"session {session!r} is already open on the gateway; close it first")
        s = _Session(session, secrets.token_hex(8), secrets.token_urlsafe(32), gen, fmt, min_version, seed,
                     max_new_tokens, max_tokens, max_turns)
        self._sessions[session] = self._slugs[s.slug] = s
        return f"{self.root}/s/{s.slug}/v1", s.key

    def close_session(self, session: str) -> Trajectory:
        """End the session (its model calls in flight are cancelled, later calls get 404) and return
        its trajectory: the longest chain, token-exact."""
        s = self._sessions.pop(session)
        del self._slugs[s.slug]
        self._cancel(s)
        self._counts["diverged"] += s.diverged
        self._counts["forks"] += s.forks
        return s.trajectory()

    def sampled(self, session: str) -> dict[str, float]:
        """What an open session's model turns were sampled at (the rollout's temperature and top_p;
        empty before its first turn): the episode's batch carries it to the trainer."""
        return dict(self._sessions[session].sampled)

    def end_session(self, session: str, finish: str, error: str | None = None) -> None:
        """Record why an open session's episode ended (its first reason stays)."""
        self._sessions[session].end(finish, error)

    def stats(self) -> dict[str, int]:
        """Counters since start: requests, unauthorized (401s), bad_requests (4xx), rollout_errors,
        and diverged / forks of the closed sessions; ``sessions`` open now."""
        return {**self._counts, "sessions": len(self._sessions)}

    # --- handlers ---------------------------------------------------------------------------------

    def _cancel(self, s: _Session) -> None:
        for task in s.inflight:
            task.cancel()

    def _auth(self, request: Any) -> _Session:
        self._counts["requests"] += 1
        s = self._slugs.get(request.match_info["slug"])
        if s is None:
            raise RequestError(404, "no such session: it ended or never existed (use the base_url the episode "
                                    "was given)", type="not_found_error")
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), s.key.encode()):
            self._counts["unauthorized"] += 1
            s.unauthorized += 1
            raise RequestError(401, "missing or wrong API key: send Authorization: Bearer <the episode's key>",
                               type="authentication_error", code="invalid_api_key")
        return s

    async def _body(self, request: Any) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as e:
            raise RequestError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported by the flowrl gateway; leave stream unset",
                               param="stream")
        n = body.get("n", 1)
        if n not in (1, None):
            raise RequestError(400, f"n={n!r}: the gateway makes one completion per call; send n=1 (or leave "
                                    "it out) and call again for more", param="n")
        return body

    def _max_new(self, s: _Session, body: dict[str, Any], prompt_len: int) -> int:
        limit = s.max_new_tokens
        for name in ("max_tokens", "max_completion_tokens"):
            v = body.get(name)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise RequestError(400, f"{name}={v!r}: must be a positive integer", param=name)
            limit = min(limit, v)
        room = s.max_tokens - prompt_len
        if room < 1:
            s.end("token_budget")
            raise RequestError(400, f"the episode's token budget is spent: the prompt holds {prompt_len} tokens, "
                                    f"the budget is {s.max_tokens}", param="messages", code="token_budget")
        return min(limit, room)

    async def _generate(self, s: _Session, prompt: list[int], max_new: int) -> Completion:
        if s.calls >= s.max_turns:
            s.end("max_turns")
            raise RequestError(400, f"the episode's turn limit is reached: {s.calls} model calls of max_turns="
                                    f"{s.max_turns}", code="max_turns")
        seed = call_seed(s.seed, s.calls)
        s.calls += 1
        task = asyncio.ensure_future(s.gen.complete(
            prompt, session=s.name, max_new_tokens=max_new, stop=tuple(s.fmt.stop_ids), min_version=s.min_version,
            seed=seed, timeout_s=self.request_timeout_s))
        s.inflight.add(task)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.request_timeout_s + 1.0)
        finally:
            s.inflight.discard(task)
        if not done:
            task.cancel()
            s.end("rollout_error", f"model call timed out after {self.request_timeout_s}s")
            raise RequestError(504, f"the model call took longer than {self.request_timeout_s}s",
                               type="timeout_error")
        if task.cancelled():
            raise RequestError(503, "the session was closed while its model call ran", type="service_unavailable")
        err = task.exception()
        if err is not None:
            self._counts["rollout_errors"] += 1
            s.end("rollout_error", f"{type(err).__name__}: {err}")
            status = 503 if isinstance(err, ServiceError) else 500
            raise RequestError(status, f"the rollout could not generate: {err}", type="service_unavailable")
        out = task.result()
        s.sampled = {"temperature": out.temperature, "top_p": out.top_p}  # the batch's, as for environments
        return out

    async def _serve(self, request: Any, handle: Any) -> Any:
        from aiohttp import web

        try:
            s = self._auth(request)
            return web.json_response(await handle(s, request))
        except RequestError as e:
            if e.status < 500 and e.status != 401:
                self._counts["bad_requests"] += 1
            return web.json_response(_error_body(e), status=e.status)

    async def _chat(self, request: Any) -> Any:
        return await self._serve(request, self._chat_call)

    async def _completions(self, request: Any) -> Any:
        return await self._serve(request, self._completions_call)

    async def _models(self, request: Any) -> Any:
        async def listing(s: _Session, request: Any) -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                 "owned_by": "flowrl"}]}
        return await self._serve(request, listing)

    async def _chat_call(self, s: _Session, request: Any) -> dict[str, Any]:
        body = await self._body(request)
        msgs = clean_messages(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise RequestError(400, "tools must be a list of {type: function, function: {...}} objects", param="tools")
        keys = [message_key(m) for m in msgs]
        plan = s.plan_chat(msgs, keys, tools)
        prompt = (plan.chain.tokens[:plan.n_tokens] if plan.chain else []) + plan.extra
        out = await self._generate(s, prompt, self._max_new(s, body, len(prompt)))
        text = s.fmt.text(out.tokens)
        try:
            calls: list[ToolCall] = list(s.fmt.tool_calls(text))
        except (ValueError, KeyError, TypeError):
            calls = []  # a malformed call is the model's answer as text; the agent code sees it
        content = _TOOL_BLOCK.sub("", text).strip() if calls else text.strip()
        call_id = s.calls - 1
        wire_calls = [{"id": c.id or f"call_{call_id}_{j}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                      for j, c in enumerate(calls)]
        answer = {"role": "assistant", "content": content,
                  "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
        s.commit(plan, out, keys, message_key(answer), len(calls), tools)
        finish = "tool_calls" if calls else ("length" if out.finish == "length" else "stop")
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if wire_calls:
            message["tool_calls"] = wire_calls
        return {"id": f"chatcmpl-{s.slug}-{call_id}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": None,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": _usage(len(prompt), len(out.tokens))}

    async def _completions_call(self, s: _Session, request: Any) -> dict[str, Any]:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            encode = getattr(s.fmt, "encode", None)
            if encode is None:
                raise RequestError(400, "prompt as text needs a chat format that can encode text; send the prompt "
                                        "as a list of token ids", param="prompt")
            ids = list(encode(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(400, "prompt must be a string or a non-empty list of token ids", param="prompt")
        plan = s.plan_ids(ids)
        out = await self._generate(s, ids, self._max_new(s, body, len(ids)))
        s.commit(plan, out, None, None, 0, None)
        return {"id": f"cmpl-{s.slug}-{s.calls - 1}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "text": s.fmt.text(out.tokens), "logprobs": None,
                             "finish_reason": "length" if out.finish == "length" else "stop"}],
                "usage": _usage(len(ids), len(out.tokens))}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
