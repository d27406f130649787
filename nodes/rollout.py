"""Rollout: samples responses with the weights of a known policy version, through a rollout engine.

Subscribes to the actor's weights; the runtime swaps them in between batches and never hands it a
batch whose required version it does not hold yet. Each output batch records the version it was
generated with (`policy_version`), which the actor's staleness bound is checked against.

The engine (`engine: {type: builtin | hf | vllm}`, see `flowrl.engines`) generates; with a
continuous engine several `process` calls share its batch, and a version may land mid-generation
(`on_new_weights`): every token then carries the version that produced it (`versions`), and the
batch's `policy_version` is its oldest token's. This node sets what to sample -- once, for the
whole graph: the temperature and top_p travel with the batch (`meta.temperature`, `meta.top_p`)
and the reference and actor read them from there.
"""

import time

from typing import Literal

from pydantic import Field

import flowrl
from flowrl.engines import BuiltinEngineSpec, EngineSpec
from flowrl.nodes.common import ModelConfig


class Rollout(flowrl.Node):
    role = "rollout"
    requires = {"prompts": "int64", "targets": "int64"}  # prompts ragged (each its own length) or [B, P]
    subscribes_weights = True
    applies_adapters = True  # adapter (LoRA) versions reach load_weights as they came; the engine merges them

    class Config(ModelConfig):
        engine: EngineSpec = Field(default_factory=BuiltinEngineSpec)
        """What generates: `{type: builtin}` (flowrl's sampler, the default), `{type: hf}`
        (transformers' generate) or `{type: vllm, ...}` (a vLLM engine in this process)."""
        samples_per_prompt: int = Field(4, ge=1)
        """Completions per prompt (GRPO's group size)."""
        temperature: float = Field(1.0, ge=0)
        """Sampling temperature (0 = greedy); carried in the batch to the reference and actor."""
        top_p: float = Field(1.0, gt=0, le=1)
        """Nucleus sampling mass; carried in the batch."""
        max_new_tokens: int | None = Field(None, ge=1)
        """Generation budget; default: what the task needs."""
        stop_token_ids: list[int] = Field(default_factory=list)
        """Token ids that end a response like EOS does (hf and vllm engines)."""
        on_new_weights: Literal["keep", "restart", "finish"] = "finish"
        """What a weights version arriving mid-generation does to the sequences in flight (continuous
        engines): `keep` goes on with the new weights (tokens record their versions), `restart`
        starts them again from their prompts, `finish` lets them end on the old weights first."""
        record_requests: bool = False
        """Write every service request's prompt and generated tokens to
        `RUN_DIR/served/<node>.<replica>.jsonl` (one line each, with its session): what
        `flowrl.agents.exact.check_run` compares the agents' trajectories with."""
        layout: Literal["ragged", "padded"] = "ragged"
        """`ragged`: every sample its own length (see nodes/common.py). `padded`: the rectangular layout
        of earlier versions (tokens [R, P+T] with prompts left-padded, response_mask / logprobs [R, T]),
        for user nodes written for it; the built-in nodes take both."""

    async def setup(self):
        from flowrl.engines import build_engine

        ctx = self.ctx
        self.ends: dict[str, tuple[int, int]] = {}
        self.engine = build_engine(self.config.engine, model=self.config.model, device=ctx.device,
                                   dtype=ctx.dtype, seed=ctx.seed, devices=ctx.devices,
                                   on_new_weights=self.config.on_new_weights)
        self.last_record = (time.perf_counter(), self.engine.stats())

    async def teardown(self):
        self.engine.close()

    def weights(self):
        """What the runtime receives each new version into: the engine's module where it may swap
        the module's storage (no copy a version: a builtin engine on devices of its own), else its
        tensors, which each complete version is copied into. A rollout that shares its devices
        (`colocate_with`) keeps the tensors: a handoff reads the trainer's region as its staging
        buffer, and a sleep between turns offloads the module's tensors, which must be its own."""
        graph = self.ctx.graph
        shares = graph is None or bool(graph.nodes[self.ctx.name].colocate_with) or any(
            self.ctx.name in node.colocate_with for node in graph.nodes.values())
        return self.engine.weights() if shares else self.engine.weight_target()

    async def before_weights(self, version):
        """Called on the compute loop before a new version's tensors are written (see on_new_weights)."""
        await self.engine.before_weights(version)

    def weights_failed(self, version):
        """The version announced by `before_weights` did not land: generation goes on as it was."""
        self.engine.resume()

    def load_weights(self, tensors, version):
        """`tensors`: the engine's own weights() holding a full version, or an adapter version's
        `P.lora_A` / `P.lora_B` tensors, which the engine applies in place (flowrl.engines.base)."""
        self.engine.load_weights(tensors.items(), version)

    def end_ids(self, tokenizer: dict | None) -> tuple[int, int]:
        """EOS and PAD ids: the tokenizer's the batch names (`meta["tokenizer"]`, written by the
        dataset source: a chat model ends a turn with its own token), else the digit tasks'."""
        from flowrl.tasks import EOS, PAD

        if tokenizer is None:
            return EOS, PAD
        key = repr(sorted(tokenizer.items()))
        if key not in self.ends:
            from flowrl.data import tokenizer_for

            tok = tokenizer_for(tokenizer)
            self.ends[key] = (tok.eos_id, tok.pad_id)
        return self.ends[key]

    async def process(self, batch, port):
        cfg = self.config
        sampling = self.sampling(batch.meta.get("tokenizer"), cfg.samples_per_prompt,
                                 cfg.max_new_tokens or batch.meta["max_new_tokens"])

        index = max(batch.index, 0)
        t0 = time.perf_counter()  # prompts: ragged, or a rectangular [B, P] of whole rows (the engine takes both)
        out = await self.engine.submit(batch.tensors["prompts"], sampling, seed=self.ctx.seed * 1_000_003 + index)
        self.record(out, time.perf_counter() - t0)
        versions = self.versions(out)
        generated = versions.values[out.loss_mask.values]
        # a group is as stale as its oldest token
        version = int(generated.min()) if generated.numel() else self.ctx.policy_version
        tensors = {"tokens": out.tokens, "loss_mask": out.loss_mask, "logprobs": out.logprobs,
                   "prompt_lens": out.prompt_lens, "versions": versions}
        if cfg.layout == "padded":
            tensors = padded_layout(out, sampling.pad_id)
        return flowrl.Batch(
            tensors={**tensors, "targets": batch.tensors["targets"].repeat_interleave(sampling.n, 0)},
            meta={**batch.meta, "samples_per_prompt": sampling.n, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "rollout_engine": cfg.engine.type},
            policy_version=version,
        )

    async def serve(self, request: dict):
        """One model turn for an agent (`services: [agent -> rollout]`): `request` holds `prompt`
        (int64 token ids, the whole conversation so far), `max_new_tokens`, `stop` (ids that end the
        turn), `seed` and optionally `tokenizer` (the client's, for EOS and PAD). Returns a
        `flowrl.agents.base.Completion`: the engine's tokens exactly, their log-probs and versions.
        Requests share the engine with each other (a continuous engine batches them)."""
        import torch

        from flowrl.agents.base import Completion

        cfg = self.config
        limit = int(request["max_new_tokens"])
        sampling = self.sampling(request.get("tokenizer"), 1, min(limit, cfg.max_new_tokens or limit),
                                 [int(t) for t in request.get("stop") or ()])
        prompt = torch.as_tensor(request["prompt"], dtype=torch.int64).reshape(1, -1)
        t0 = time.perf_counter()
        out = await self.engine.submit(flowrl.Ragged.from_padded(prompt), sampling, seed=int(request.get("seed", 0)))
        self.record(out, time.perf_counter() - t0)
        mask = out.loss_mask.values
        tokens, versions = out.tokens.values[mask], self.versions(out).values[mask]
        stopped = len(tokens) > 0 and int(tokens[-1]) in sampling.stops
        if cfg.record_requests:
            self.served(request, prompt[0].tolist(), tokens.tolist())
        return Completion(tokens=tokens.tolist(), logprobs=out.logprobs.values[mask].float().tolist(),
                          versions=versions.tolist(), finish="stop" if stopped else "length",
                          replica=self.ctx.replica, temperature=sampling.temperature, top_p=sampling.top_p)

    def sampling(self, tokenizer: dict | None, n: int, max_new_tokens: int, stop: list[int] = ()):
        """What to sample, from this node's config: `stop` (a service request's end-of-turn ids, the
        first of them its EOS) comes on top of the configured stop tokens."""
        from flowrl.engines import Sampling

        cfg = self.config
        eos, pad = self.end_ids(tokenizer)
        if stop:
            eos, stop = stop[0], stop[1:]
        return Sampling(n=n, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=max_new_tokens,
                        eos_id=eos, pad_id=pad, stop_token_ids=tuple(dict.fromkeys([*cfg.stop_token_ids, *stop])))

    def versions(self, out):
        """The version of every token (aligned; -1 off the response): the engine's, or -- one version
        made every token -- the one the runtime says we hold."""
        import torch

        if out.versions is not None:
            return out.versions
        return out.tokens.like(torch.where(out.loss_mask.values, self.ctx.policy_version, -1))

    def served(self, request: dict, prompt: list[int], tokens: list[int]) -> None:
        """One line of `RUN_DIR/served/`: the engine's own record of what it was asked and gave."""
        import json

        if self.ctx.run_dir is None:
            return
        folder = self.ctx.run_dir / "served"
        folder.mkdir(exist_ok=True)
        with open(folder / f"{self.ctx.name}.{self.ctx.replica}.jsonl", "a") as f:
            f.write(json.dumps({"session": request.get("session"), "prompt": prompt, "tokens": tokens}) + "\n")

    def record(self, out, seconds: float) -> None:
        """Latency and tokens of this call; the engine's occupancy since the previous record."""
        rec = self.ctx.recorder
        rec.observe("rollout_latency_s", seconds)
        rec.count("rollout_tokens_generated", int(out.loss_mask.values.sum()))
        now, stats = time.perf_counter(), self.engine.stats()
        (then, before), self.last_record = self.last_record, (now, stats)
        if not stats:
            return
        rec.gauge("engine_running", stats["running"], across="sum")
        rec.gauge("engine_waiting", stats["waiting"], across="sum")
        if now > then:
            rec.gauge("rollout_busy", (stats["busy_s"] - before.get("busy_s", 0.0)) / (now - then))
        rec.count("weight_pause_s", stats["weight_pause_s"] - before.get("weight_pause_s", 0.0))

    async def sleep(self):
        """A colocated node's turn (`take_turns`): the engine sleeps (flowrl.engines.sleep: level 2,
        KV caches and weights; vLLM sleeps itself where its build can), back exactly on `wake`."""
        from flowrl.engines.sleep import EngineSleep
        from flowrl.rl.offload import sleep_path

        if getattr(self, "sleeper", None) is None:
            self.sleeper = EngineSleep(self.engine, sleep_path(self.ctx, "engine"), level=2)
        self.sleeper.sleep()

    async def wake(self):
        if getattr(self, "sleeper", None) is not None:
            self.sleeper.wake()


def padded_layout(out, pad: int) -> dict:
    """The rectangular layout: prompts left-padded to one width, responses right-padded to another."""
    import torch

    from flowrl.models.generation import prompt_grid, response_grid

    tokens = response_grid(out.tokens, out.prompt_lens, pad)
    width = tokens.shape[1]
    return {"tokens": torch.cat([prompt_grid(out.tokens, out.prompt_lens, pad), tokens], dim=1),
            "response_mask": torch.arange(width)[None] < (out.tokens.lengths - out.prompt_lens)[:, None],
            "logprobs": response_grid(out.logprobs, out.prompt_lens, 0.0, width)}
