"""Runs inside vLLM's worker (mixed into its class through ``worker_extension_cls``): what flowrl
asks of the worker beyond vLLM's own ``reload_weights``.

Reached with ``llm.collective_rpc("flowrl_<method>")``; on a tensor-parallel engine every rank
answers. Imports nothing of flowrl, so the worker can load it by name wherever it runs.
"""

from __future__ import annotations

import hashlib

import torch


class FlowrlWorkerExtension:
    """``self`` is vLLM's worker: ``self.model_runner.get_model()`` is the engine's model."""

    def flowrl_engine_weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, by vLLM parameter name, on CPU.

        vLLM's CPU backend packs linear weights into kernel formats and leaves the parameter empty
        (``shape (0,)``); such a weight is read back by applying the layer's kernel to the identity
        (``I @ W^T``), which is exact in float32. Vocabulary-padded rows are cut off."""
        model = self.model_runner.get_model()
        modules = dict(model.named_modules())
        out: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            module = modules[name.rsplit(".", 1)[0]] if "." in name else model
            if param.numel() == 0 and hasattr(module, "cpu_linear"):
                k = int(getattr(module, "input_size_per_partition", getattr(module, "input_size", 0)))
                eye = torch.eye(k, dtype=param.dtype)
                with torch.no_grad():
                    value = module.cpu_linear(eye, None, None).t()
            else:
                value = param.detach()
            rows = getattr(module, "org_vocab_size", None)
            if rows is not None and name.endswith("weight"):  # padded vocabulary (one rank: tp = 1)
                value = value[: int(rows)]
            out[name] = value.to("cpu").contiguous().clone()
        return out

    def flowrl_digest(self) -> str:
        """sha256 over (name, dtype, shape, bytes) of :meth:`flowrl_engine_weights`, names sorted."""
        return digest(self.flowrl_engine_weights())


def digest(named: dict[str, torch.Tensor]) -> str:
    """The same digest for tensors held anywhere (the test side computes it over the trainer's)."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
