"""A :class:`~flowrl.agents.base.Generator` over a rollout engine in this process (tests, benchmarks).

    >>> engine = build_engine({"type": "builtin", "continuous": True}, model=spec, seed=0)  # doctest: +SKIP
    >>> gen = EngineGenerator(engine, temperature=1.0)
    >>> out = await gen.complete([12, 5, 3], session="s", max_new_tokens=8, stop=(13,))    # doctest: +SKIP

Each ``complete`` is one ``engine.submit`` of one prompt (``n=1``). With a continuous engine the
requests of every episode in flight share its decode batch -- what a rollout replica does for
the requests of a service -- so a ticket's episodes run as fast as one batched generation per
turn. The built-in engine stops at its EOS only: the first stop id is passed as EOS, and a
completion is cut after the first of the other stop ids (its tokens and log-probs are unchanged
up to there). Versions: the engine's per-token ones when it reports them, else ``version_fn()``
(default: ``engine.version``) for every token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from flowrl.agents.base import Completion, ServiceError


class EngineGenerator:
    def __init__(self, engine, temperature: float = 1.0, top_p: float = 1.0,
                 version_fn: Callable[[], int] | None = None, pad_id: int | None = None):
        self.engine = engine
        self.temperature, self.top_p = temperature, top_p
        self.version_fn = version_fn or (lambda: int(getattr(engine, "version", 0)))
        self.pad_id = pad_id
        self.requests = 0

    async def complete(self, prompt: Sequence[int], *, session: str, max_new_tokens: int,
                       stop: Sequence[int] = (), min_version: int = 0, seed: int = 0,
                       timeout_s: float | None = None) -> Completion:
        from flowrl.engines import Sampling
        from flowrl.tasks import EOS, PAD
        from flowrl.transport.ragged import Ragged

        stop = tuple(int(s) for s in stop) or (EOS,)
        sampling = Sampling(n=1, temperature=self.temperature, top_p=self.top_p, max_new_tokens=max_new_tokens,
                            eos_id=stop[0], pad_id=PAD if self.pad_id is None else self.pad_id)
        prompts = Ragged.from_sequences([list(prompt)], "int64")
        self.requests += 1
        try:
            job = self.engine.submit(prompts, sampling, seed=seed)
            out = await (asyncio.wait_for(job, timeout_s) if timeout_s is not None else job)
        except asyncio.TimeoutError:
            raise ServiceError(f"session {session}: no completion within {timeout_s:g}s") from None
        except ValueError as e:  # a prompt the engine refuses (too long for its context)
            raise ServiceError(f"session {session}: the engine refused the request: {e}") from None
        p = int(out.prompt_lens[0])
        tokens = [int(t) for t in out.tokens[0][p:]]
        logprobs = [float(x) for x in out.logprobs[0][p:]]
        if out.versions is not None:
            versions = [int(v) for v in out.versions[0][p:]]
        else:
            versions = [self.version_fn()] * len(tokens)
        finish = "length"
        for k, t in enumerate(tokens):
            if t in stop:
                tokens, logprobs, versions, finish = tokens[: k + 1], logprobs[: k + 1], versions[: k + 1], "stop"
                break
        return Completion(tokens, logprobs, versions, finish, temperature=self.temperature, top_p=self.top_p)
