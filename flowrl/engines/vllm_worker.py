"""Runs inside vLLM's worker (mixed into its class through ``worker_extension_cls``): what flowrl
asks of the worker beyond vLLM's own ``reload_weights``.

``flowrl_reload`` is vLLM's in-place reload made safe to fail: vLLM's layerwise reload moves each
layer onto the meta device and buffers its weights until the layer is complete, so an error
partway (a bad tensor, an exception in the weights iterator, a kernel re-pack that raises) leaves
the model with some layers on the new version, the rest on meta with wrapped loaders -- and a
second reload on top of that silently mixes the two attempts. On an error it first puts every
unfinished layer's previous kernel tensors back (their contents are untouched: processing copies
into them only once a layer is complete), so the engine can be reloaded again at once.

``flowrl_lora_set`` serves an adapter version through vLLM's own LoRA support (``lora: serve``): the
engine holds one adapter, id ``LORA_ID``, registered and pinned at start-up (empty: the base) and
named by every request; a version is built into a ``LoRAModel`` from the tensors in memory (no
folder), then written into that adapter's slot of every LoRA layer in place, so the sequences in
flight compute with it from the next step, as with a reload. If writing raises partway, the
previous adapter is written back before the error is reported.

Reached with ``llm.collective_rpc("flowrl_<method>")``; on a tensor-parallel engine every rank
answers. Imports nothing of flowrl, so the worker can load it by name wherever it runs.
"""

from __future__ import annotations

import hashlib
import logging

import torch

LORA_ID = 1
"""The int id of the one adapter a ``lora: serve`` engine holds (every request names it)."""
LORA_NAME = "flowrl-policy"
LORA_PATH = "flowrl://in-memory"
"""What ``LoRARequest`` needs as a path; never read: the adapter is registered from memory and pinned."""


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
        lora_manager = getattr(self.model_runner, "lora_manager", None)
        mgr = lora_manager._adapter_manager if lora_manager is not None else None
        served = mgr.get_adapter(LORA_ID) if mgr is not None else None
        try:
            self.model_runner.reload_weights(weights_iterator=counted())
        except BaseException:
            abort_layerwise_reload(self.model_runner.get_model())
            raise
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
            if served is not None and mgr.get_adapter(LORA_ID) is None:  # vLLM's reload drops every adapter
                _register(mgr, served)
        return consumed[0]

    def flowrl_engine_weights(self, effective: bool = False) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, by vLLM parameter name, on CPU.

        With LoRA enabled the names lose LoRA's ``.base_layer``; ``effective``: each adapted
        weight is ``base + B @ A`` of the adapter served (float32, cast back), as a merge computes it.
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
            out[name.replace(".base_layer.", ".")] = value.to("cpu").contiguous().clone()
        if effective and getattr(self.model_runner, "lora_manager", None) is not None:
            mgr = self.model_runner.lora_manager._adapter_manager
            lora = mgr.get_adapter(LORA_ID)
            for module in mgr.modules if lora is not None else ():
                w = mgr._get_lora_layer_weights(lora, module)
                if w is None or f"{module}.weight" not in out:
                    continue
                base = out[f"{module}.weight"]
                parts = list(zip(w.lora_a, w.lora_b)) if isinstance(w.lora_a, list) else [(w.lora_a, w.lora_b)]
                sizes = _slice_sizes(mgr.modules[module], base.shape[0], len(parts))
                rows = []
                for (a, b), chunk in zip(parts, base.split(sizes)):
                    rows.append(chunk if a is None else
                                (chunk.float() + b.float() @ a.float()).to(base.dtype))
                out[f"{module}.weight"] = torch.cat(rows)
        return out

    def flowrl_lora_set(self, tensors: dict[str, torch.Tensor] | None, rank: int,
                        fail_after: int | None = None, restore_fail_after: int | None = None) -> dict:
        """Serve ``tensors`` (peft names: ``base_model.model.<P>.lora_A.weight`` [r, in], ``..lora_B.weight``
        [out, r], pre-scaled) as adapter ``LORA_ID``; None: the empty adapter (the base). Checked
        whole before any slot changes (a ``ValueError`` then). Returns ``{"modules": written}``, or
        ``{"error": ..., "restored": bool}`` when writing raised partway and the previous adapter was
        written back (or that failed too). Tests: ``fail_after`` / ``restore_fail_after`` make the
        write / the write back raise once that many modules were written."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        mgr = manager._adapter_manager
        tensors = tensors or {}
        r = max(int(rank), 1)
        targets = sorted({n.split(".")[-3] for n in tensors})
        peft = PEFTHelper(r=r, lora_alpha=r, target_modules=targets)  # alpha = r: B arrives pre-scaled
        peft.validate_legal(manager.lora_config)
        lora = LoRAModel.from_lora_tensors(LORA_ID, tensors, peft, device="cpu", dtype=manager.lora_config.lora_dtype)
        if lora.loras:  # (vLLM's packing assumes at least one)
            mgr._create_merged_loras_inplace(lora)
        unknown = sorted(set(lora.loras) - set(mgr.modules))
        if unknown:
            raise ValueError(f"vLLM serves no LoRA on {unknown[:3]} (it adapts {sorted(mgr.supported_lora_modules)} "
                             "and their parts); nothing was applied. Use `lora: merge` to merge such adapters")
        previous = mgr.get_adapter(LORA_ID)
        if previous is None:  # start-up
            _register(mgr, lora)
            return {"modules": len(lora.loras)}
        index = mgr.lora_index_to_id.index(LORA_ID)
        try:
            written = _write_slot(mgr, index, lora, fail_after)
        except Exception as e:  # noqa: BLE001 - the previous adapter goes back, then the caller hears it
            error = f"{type(e).__name__}: {e}"
            try:
                _write_slot(mgr, index, previous, restore_fail_after)
            except Exception as again:  # noqa: BLE001
                return {"error": f"{error}; restoring the previous adapter failed too ({again})", "restored": False}
            return {"error": error, "restored": True}
        mgr._registered_adapters[LORA_ID] = lora  # pinned key, new value
        return {"modules": written}

    def flowrl_lora_weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """What each LoRA layer's slot of ``LORA_ID`` holds, by checkpoint module name (``..q_proj``,
        fused layers split into their parts): ``(A [max_rank, in], B [out, max_rank])``, zero-padded."""
        mgr = self.model_runner.lora_manager._adapter_manager
        index = mgr.lora_index_to_id.index(LORA_ID)
        packed = mgr.packed_modules_mapping
        out = {}
        for name, module in mgr.modules.items():
            a_stacked, b_stacked = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
            if not isinstance(a_stacked, tuple) or not isinstance(b_stacked, tuple):
                continue  # embeddings, logits: not a linear layer's adapter
            stem, leaf = name.rsplit(".", 1)
            parts = packed.get(leaf, [leaf]) if len(a_stacked) > 1 else [leaf]
            for part, a, b in zip(parts, a_stacked, b_stacked):
                out[f"{stem}.{part}"] = (a[index, 0].detach().cpu().clone(), b[index, 0].detach().cpu().clone())
        return out

    def flowrl_digest(self, effective: bool = False) -> str:
        """sha256 over (name, dtype, shape, bytes) of :meth:`flowrl_engine_weights`, names sorted."""
        return digest(self.flowrl_engine_weights(effective))


def _register(mgr, lora) -> None:
    """Register the adapter (packed already), write it into a slot and pin it there (never evicted,
    never read from a path)."""
    mgr._registered_adapters[LORA_ID] = lora
    mgr.activate_adapter(LORA_ID)
    mgr.pin_adapter(LORA_ID)


def _write_slot(mgr, index: int, lora, fail_after: int | None) -> int:
    """Write ``lora`` into slot ``index`` of every LoRA layer (what ``activate_adapter`` does)."""
    written = 0
    for n, (name, module) in enumerate(mgr.modules.items()):
        if fail_after is not None and n >= fail_after:
            raise RuntimeError(f"injected adapter failure after {fail_after} modules")
        w = mgr._get_lora_layer_weights(lora, name)
        if w is None:
            module.reset_lora(index)
            continue
        module.set_lora(index, w.lora_a, w.lora_b)
        written += 1
    return written


def _slice_sizes(module, rows: int, n: int) -> list[int]:
    """Output rows of each part of a fused LoRA layer (q/k/v, gate/up) on this rank."""
    sizes = list(getattr(module, "output_slices", ()) or ())
    return sizes if len(sizes) == n and sum(sizes) == rows else [rows]


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
