"""Runs inside vLLM's worker (mixed into its class through ``worker_extension_cls``): what flowrl
asks of the worker beyond vLLM's own ``reload_weights``.

``flowrl_reload`` is vLLM's in-place reload made safe to fail: vLLM's layerwise reload moves each
layer onto the meta device and buffers its weights until the layer is complete, so an error
partway (a bad tensor, an exception in the weights iterator, a kernel re-pack that raises) leaves
the model with some layers on the new version, the rest on meta with wrapped loaders -- and a
second reload on top of that silently mixes the two attempts. On an error it first puts every
unfinished layer's previous kernel tensors back (their contents are untouched: processing copies
into them only once a layer is complete), so the engine can be reloaded again at once.

Reached with ``llm.collective_rpc("flowrl_<method>")``; on a tensor-parallel engine every rank
answers. Imports nothing of flowrl, so the worker can load it by name wherever it runs.
"""

from __future__ import annotations

import hashlib
import logging

import torch


class FlowrlWorkerExtension:
    """``self`` is vLLM's worker: ``self.model_runner.get_model()`` is the engine's model."""

    def flowrl_reload(self, weights_iterator, fail_after: int | None = None, partial: bool = False) -> int:
        """``model_runner.reload_weights(weights_iterator)``; returns the tensors consumed.

        On an error the half-done reload is undone (see the module docstring) and the error is
        raised again. ``fail_after`` (tests): raise once that many tensors went into the engine.
        ``partial``: only some layers are given (an adapter version); the others keep their
        weights, and vLLM's warnings about each of them are not printed."""
        consumed = [0]

        def counted():
            for item in weights_iterator:
                if fail_after is not None and consumed[0] >= fail_after:
                    raise RuntimeError(f"injected reload failure after {fail_after} tensors")
                consumed[0] += 1
                yield item

        quiet = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
        levels = [q.level for q in quiet]
        for q in quiet if partial else ():
            q.setLevel(logging.ERROR)
        try:
            self.model_runner.reload_weights(weights_iterator=counted())
        except BaseException:
            abort_layerwise_reload(self.model_runner.get_model())
            raise
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
        return consumed[0]

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


def abort_layerwise_reload(model) -> int:
    """Undo what a reload that raised left behind; returns the layers put back.

    Every layer still waiting for weights gets its previous kernel tensors back (registered
    again in place of the meta ones), its buffered loads are dropped and its loaders unwrapped."""
    from vllm.model_executor.model_loader.reload import layerwise

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    restored = 0
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
            restored += 1
        info.reset()
    layerwise.LOADING_LAYERS.clear()
    return restored


def digest(named: dict[str, torch.Tensor]) -> str:
    """The same digest for tensors held anywhere (the test side computes it over the trainer's)."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
