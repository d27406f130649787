"""Tensors offloaded between turns and brought back exactly (colocated nodes that take turns).

    off = Offload(folder / "actor.0.0.pt")
    off.put(trainer_tensors(trainer))     # parameters, gradients, optimizer state: memory released
    ...                                   # another node's turn
    off.take()                            # the same tensor objects hold the same values again

On a GPU the tensors go to host memory (pinned) and the device memory is freed. On a CPU "host
memory" is the memory they are in: to release it they go to a file (`folder`, the run directory's
`sleep/`), and are read back on `take`. Either way the tensor *objects* stay (their storages are
resized to nothing and back), so the optimizer, the model and every other view of the same
storage (a `state_dict()` alias a weight subscriber writes into) keep working and see the values
again after `take`.
"""

from __future__ import annotations

from pathlib import Path

import torch


class Offload:
    """One node's offloaded storages: their bytes while away (host memory or a file)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.storages: list[tuple[torch.UntypedStorage, int]] = []  # (storage, its size in bytes)
        self.host: list[torch.Tensor] = []  # their bytes in host memory (GPU storages)
        self.away = False

    def put(self, tensors: dict[str, torch.Tensor]) -> int:
        """Release the memory of `tensors` (every storage once, however many tensors view it);
        returns the bytes released."""
        if self.away:
            return 0
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for t in tensors.values():
            st = t.untyped_storage()
            if not st.resizable():  # mapped from a file (or another process): not ours to release
                continue
            if st.nbytes() and st.data_ptr() not in seen:
                seen[st.data_ptr()] = (st, st.nbytes())
        self.storages = list(seen.values())
        saved = [_bytes_of(st).clone() if st.device.type == "cpu" else
                 torch.empty(n, dtype=torch.uint8, pin_memory=True).copy_(_bytes_of(st))
                 for st, n in self.storages]
        on_cpu = any(st.device.type == "cpu" for st, _ in self.storages)
        if on_cpu:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save([b for b, (st, _) in zip(saved, self.storages) if st.device.type == "cpu"], self.path)
        self.host = [b for b, (st, _) in zip(saved, self.storages) if st.device.type != "cpu"]
        del saved
        for st, _ in self.storages:
            st.resize_(0)  # every tensor viewing it (a parameter, its state_dict alias) gives it up
        self.away = True
        return sum(n for _, n in self.storages)

    def take(self) -> None:
        """Every storage `put` released holds its bytes again (bitwise)."""
        if not self.away:
            return
        on_file = iter(torch.load(self.path, weights_only=True, mmap=True)) if self.path.exists() else iter(())
        host = iter(self.host)
        for st, n in self.storages:
            st.resize_(n)
            _bytes_of(st).copy_(next(on_file) if st.device.type == "cpu" else next(host))
        self.path.unlink(missing_ok=True)
        self.storages, self.host, self.away = [], [], False


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def trainer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """What a trainer holds between updates: parameters, buffers, gradients, optimizer state."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = p
        if p.grad is not None:
            out[f"grad.{name}"] = p.grad
    for name, b in model.named_buffers():
        out[f"buffer.{name}"] = b
    if optimizer is not None:
        for i, state in enumerate(optimizer.state.values()):
            for key, value in state.items():
                if torch.is_tensor(value) and value.numel() > 1:
                    out[f"optim.{i}.{key}"] = value
    return out


def module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An inference model's parameters and buffers."""
    return {**{f"param.{n}": p for n, p in model.named_parameters()},
            **{f"buffer.{n}": b for n, b in model.named_buffers()}}


def sleep_path(ctx, what: str) -> Path:
    """Where a node's offload file goes: `RUN_DIR/sleep/<node>.<replica>.<rank>.<what>.pt`."""
    import tempfile

    base = Path(ctx.run_dir) / "sleep" if ctx.run_dir is not None else Path(tempfile.gettempdir()) / "flowrl-sleep"
    return base / f"{ctx.name}.{ctx.replica}.{ctx.rank}.{what}.pt"
