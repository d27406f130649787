"""Continuous batching for the built-in engine: iteration-level scheduling (Orca) over a slot KV cache.

    >>> engine = build_engine({"type": "builtin", "continuous": True, "max_num_seqs": 32},
    ...                       model={"type": "tiny"}, seed=0, on_new_weights="keep")  # doctest: +SKIP
    >>> outs = await asyncio.gather(engine.submit(a, sampling, seed=0),               # doctest: +SKIP
    ...                             engine.submit(b, other_sampling, seed=1))

Every ``submit`` (a rollout ticket) puts its ``len(prompts) * n`` sequences in one queue and awaits
them. One task on the caller's event loop (started by the first ``submit``, ended when nothing is
left) runs iterations, each synchronous torch work on that thread:

1. admit waiting sequences into free slots of the :class:`~flowrl.models.tiny.SlotCache` and prefill
   them together (right-padded, each in its own slot);
2. run one decode step for every sequence that was already running, all rows at once, each at its
   own length;
3. sample one token per sequence (rows grouped by temperature and top-p), retire the sequences that
   stopped (EOS or their request's ``max_new_tokens``), free their slots for the next admission,
   and resolve a request once all its sequences are done;
4. ``await asyncio.sleep(0)``: other tasks of the loop (new submits, a weights version) run between
   two iterations -- never during one.

So a short response leaves the batch at once and a waiting sequence takes its slot; nothing waits
for the slowest sample of a batch. The price: the draws come from one engine-level generator
(seeded from the engine's seed), so a sample depends on what else ran beside it, as in vLLM;
``submit``'s ``seed`` is not used. Greedy tokens and every log-prob are those of the model alone.

Weights (``on_new_weights``): ``before_weights`` runs on the loop between two iterations, the
runtime then writes the new tensors, then ``weights_loaded`` resumes. ``keep``: the running
sequences pause and go on with the new weights (partial rollouts: each token records its version);
``restart``: they drop their tokens and start again from their prompts; ``finish``: admission stops
and ``before_weights`` returns once the running sequences are done on the old weights.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from flowrl.engines.base import Sampling, repeat_prompts
from flowrl.models.generation import Generation
from flowrl.models.sampling import sample_next
from flowrl.transport.ragged import Ragged

MODES = ("keep", "restart", "finish")


@dataclass(eq=False)
class _Request:
    """One ``submit``: its prompts, what to sample, and the future its caller awaits."""

    prompts: Ragged
    sampling: Sampling
    future: asyncio.Future
    seqs: list["_Seq"] = field(default_factory=list)
    left: int = 0
    """Sequences not finished yet."""


@dataclass(eq=False)
class _Seq:
    """One sample: its prompt and what has been generated for it so far."""

    request: _Request
    prompt: torch.Tensor
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int = -1
    """Its KV-cache slot while running, -1 otherwise."""

    @property
    def cached(self) -> int:
        """Positions its slot holds: the prompt and every generated token but the last."""
        return len(self.prompt) + max(len(self.tokens) - 1, 0)

    def reset(self) -> None:
        self.tokens.clear(), self.logprobs.clear(), self.versions.clear()


class ContinuousBatcher:
    """The scheduler and its KV cache; owned by a :class:`~flowrl.engines.builtin.BuiltinEngine`."""

    def __init__(self, model: torch.nn.Module, *, max_num_seqs: int, max_len: int, seed: int, device: str) -> None:
        self.model = model
        self.cache = model.new_slot_cache(max_num_seqs, max_len)
        self.free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest slot first
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.version = 0
        self.admitting = True
        """False while a ``finish`` weight load waits for the running sequences."""
        self.paused = False
        """True from ``before_weights`` (keep / restart) until ``weights_loaded``: no iteration runs."""
        self.busy_s = self.weight_pause_s = 0.0
        self.tokens = self.weight_loads = 0
        self._pause_start: float | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Future | None = None
        self._drain_waiters: list[asyncio.Future] = []

    # ------------------------------------------------------------------------------- callers
    async def submit(self, prompts: Ragged, sampling: Sampling) -> Generation:
        """The ``len(prompts) * n`` samples of ``prompts``, generated among everything else in flight."""
        loop = asyncio.get_running_loop()
        req = _Request(prompts, sampling, loop.create_future())
        req.seqs = [_Seq(req, p) for p in repeat_prompts(prompts, sampling.n)]
        req.left = len(req.seqs)
        self._start(loop)
        self.waiting.extend(req.seqs)
        self._notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            self._drop(req)  # the caller gave up: its sequences leave the batch, their slots free up
            raise

    async def before_weights(self, mode: str) -> None:
        """Stop between two iterations for a new version (see the module docstring for ``mode``)."""
        if mode not in MODES:
            raise ValueError(f"on_new_weights={mode!r}; choose one of {', '.join(MODES)}")
        if self._pause_start is None:
            self._pause_start = time.perf_counter()
        if mode == "finish":
            self.admitting = False
            while self.running:
                fut = asyncio.get_running_loop().create_future()
                self._drain_waiters.append(fut)
                await fut
            return
        self.paused = True
        if mode == "restart":
            for seq in reversed(self.running):  # back to the front of the queue, in their order
                self._release(seq)
                seq.reset()
                self.waiting.appendleft(seq)
            self.running = []

    def weights_loaded(self, version: int) -> None:
        """The new tensors are in place: tokens from now on carry ``version``; resume."""
        self.version = version
        self.weight_loads += 1
        if self._pause_start is not None:
            self.weight_pause_s += time.perf_counter() - self._pause_start
            self._pause_start = None
        self.paused, self.admitting = False, True
        self._notify()

    def stats(self) -> dict[str, float]:
        return {"running": len(self.running), "waiting": len(self.waiting), "busy_s": self.busy_s,
                "tokens": self.tokens, "weight_pause_s": self.weight_pause_s, "weight_loads": self.weight_loads}

    def close(self) -> None:
        """Cancel the engine loop (every waiting caller gets CancelledError)."""
        task = self._task
        if task is None or task.done() or task.get_loop().is_closed():
            return
        _call_on(task.get_loop(), task.cancel)

    # ------------------------------------------------------------------------------- the loop
    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is not None and not self._task.done():
            if self._task.get_loop() is not loop:
                raise RuntimeError("the continuous engine is generating on another event loop; submit from "
                                   "the loop it runs on (the node's compute loop)")
            return
        self._task = loop.create_task(self._run(), name="flowrl-continuous-engine")

    async def _run(self) -> None:
        try:
            while self.running or self.waiting:
                if self.paused or not (self.running or self.admitting):
                    await self._idle()
                    continue
                self._iterate()
                await asyncio.sleep(0)  # new submits, a weights version, cancellations run here
        except asyncio.CancelledError:
            self._fail_all(None)
            raise
        except Exception as exc:  # noqa: BLE001 -- every waiter gets it; none hangs
            self._fail_all(exc)

    async def _idle(self) -> None:
        self._wakeup = asyncio.get_running_loop().create_future()
        try:
            await self._wakeup
        finally:
            self._wakeup = None

    def _notify(self) -> None:
        fut = self._wakeup
        if fut is not None and not fut.done():
            _call_on(fut.get_loop(), lambda: fut.done() or fut.set_result(None))

    # ------------------------------------------------------------------------------- one iteration
    @torch.no_grad()
    def _iterate(self) -> None:
        t0 = time.perf_counter()
        decoding = list(self.running)
        admitted = self._admit() if self.admitting else []
        parts = []
        if decoding:
            parts.append(self._decode(decoding))
        if admitted:
            parts.append(self._prefill(admitted))
        seqs = decoding + admitted
        tokens, logprobs = self._sample(seqs, torch.cat(parts) if len(parts) > 1 else parts[0])
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.tokens.append(tok), seq.logprobs.append(lp), seq.versions.append(self.version)
            s = seq.request.sampling
            if tok == s.eos_id or len(seq.tokens) >= s.max_new_tokens:
                self._finish(seq)
        self.running = [seq for seq in self.running if seq.slot >= 0]
        self.tokens += len(seqs)
        self.busy_s += time.perf_counter() - t0
        self._check_drained()

    def _admit(self) -> list[_Seq]:
        admitted = []
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.slot = self.free.pop()
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def _prefill(self, seqs: list[_Seq]) -> torch.Tensor:
        """``[A, V]``: logits after each prompt; the prompts right-padded into one call."""
        lens = torch.tensor([len(seq.prompt) for seq in seqs])
        tokens = Ragged.from_sequences([seq.prompt for seq in seqs], "int64").to_torch().to_padded(0)
        return self.model.forward_slots(tokens.to(self._device), self.cache, self._slots(seqs),
                                        torch.zeros(len(seqs), dtype=torch.int64), last=lens - 1)

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """``[B, V]``: feed each sequence's last token at its own position."""
        tokens = torch.tensor([[seq.tokens[-1]] for seq in seqs], device=self._device)
        starts = torch.tensor([seq.cached for seq in seqs])
        return self.model.forward_slots(tokens, self.cache, self._slots(seqs), starts)[:, 0]

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token per row and its log-prob; rows that share (temperature, top_p) sample together."""
        groups: dict[tuple[float, float], list[int]] = {}
        for i, seq in enumerate(seqs):
            groups.setdefault((seq.request.sampling.temperature, seq.request.sampling.top_p), []).append(i)
        if len(groups) == 1:
            (temperature, top_p), = groups
            tok, lp = sample_next(logits, temperature, top_p, self.generator)
            return tok.tolist(), lp.tolist()
        tok = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        lp = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        for (temperature, top_p), rows in groups.items():
            idx = torch.tensor(rows, device=logits.device)
            tok[idx], lp[idx] = sample_next(logits[idx], temperature, top_p, self.generator)
        return tok.tolist(), lp.tolist()

    @property
    def _device(self) -> torch.device:
        return self.cache.keys[0].device

    def _slots(self, seqs: list[_Seq]) -> torch.Tensor:
        return torch.tensor([seq.slot for seq in seqs], device=self._device)

    # ------------------------------------------------------------------------------- endings
    def _release(self, seq: _Seq) -> None:
        if seq.slot >= 0:
            self.free.append(seq.slot)
            seq.slot = -1

    def _finish(self, seq: _Seq) -> None:
        self._release(seq)
        req = seq.request
        req.left -= 1
        if req.left == 0 and not req.future.done():
            req.future.set_result(assemble(req.prompts, req.sampling, req.seqs))

    def _drop(self, req: _Request) -> None:
        """Take a cancelled request's sequences out of the queue and the batch."""
        self.waiting = deque(seq for seq in self.waiting if seq.request is not req)
        for seq in req.seqs:
            self._release(seq)
        self.running = [seq for seq in self.running if seq.slot >= 0]
        self._check_drained()
        self._notify()

    def _fail_all(self, exc: BaseException | None) -> None:
        """End every request in flight with ``exc`` (None: cancelled); every slot is free again."""
        for req in {seq.request: None for seq in [*self.running, *self.waiting]}:
            if not req.future.done():
                req.future.cancel() if exc is None else req.future.set_exception(exc)
        for seq in self.running:
            self._release(seq)
        self.running, self.waiting = [], deque()
        self._check_drained()

    def _check_drained(self) -> None:
        if not self.running:
            waiters, self._drain_waiters = self._drain_waiters, []
            for fut in waiters:
                if not fut.done():
                    _call_on(fut.get_loop(), lambda f=fut: f.done() or f.set_result(None))


def assemble(prompts: Ragged, sampling: Sampling, seqs: list[_Seq]) -> Generation:
    """The engine layout (:class:`Generation`, ``versions`` set) of one request's finished sequences."""
    width = max(len(seq.tokens) for seq in seqs)
    pad = [sampling.pad_id] * width
    grid = torch.tensor([seq.tokens + pad[len(seq.tokens):] for seq in seqs], dtype=torch.int64)
    lp = torch.tensor([seq.logprobs + [0.0] * (width - len(seq.tokens)) for seq in seqs], dtype=torch.float32)
    ver = torch.tensor([seq.versions + [-1] * (width - len(seq.tokens)) for seq in seqs], dtype=torch.int64)
    mask = torch.arange(width)[None] < torch.tensor([len(seq.tokens) for seq in seqs])[:, None]
    out = Generation.from_grids(prompts, grid, mask, lp, sampling.n)
    versions = torch.full_like(out.tokens.values, -1)
    versions[out.loss_mask.values] = ver[mask]  # both row-major: sample by sample, token by token
    return out._replace(versions=out.tokens.like(versions))


def _call_on(loop: asyncio.AbstractEventLoop, fn) -> None:
    """Run ``fn`` on ``loop``: now when called on it, else soon (from another thread)."""
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        fn()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(fn)
