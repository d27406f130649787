"""The NCCL paths of flowrl on a GPU machine, in one short run that prints a table.

    python benchmarks/gpu_check.py                # on a machine with CUDA; exits 0 with a message without
    python benchmarks/gpu_check.py --mb 1024      # size of the published state (default 512 MiB)
    python benchmarks/gpu_check.py --cpu --mb 8   # the same code over gloo on CPU (how CI checks this file)

1. the GPU inventory as NVML reports it (what `flowrl check` plans on);
2. a data-parallel actor (`ActorTrainer`, FSDP2) over NCCL: 2 ranks on GPUs 0 and 1 if there are
   two, else 1 rank; 3 updates, then its parameters against a 1-rank trainer on the whole batches;
3. (2 GPUs) weight publish: `WeightPublisher` on GPU 0 -> `WeightSubscriber` on GPU 1 over NCCL,
   against a raw NCCL broadcast of the same bytes between the same two processes;
4. colocation (`take_turns`, docs/colocation.md): a trainer's sleep and wake (`flowrl.rl.offload`:
   parameters and Adam state to host memory and back) with `torch.cuda.memory_allocated` before and
   after, bitwise on wake; and the weight handoff between two processes on ONE GPU
   (`flowrl.weights.handoff`: the send buckets' CUDA IPC handle travels sealed in the store; the
   subscriber copies out of the shared region into its own weights), per version, against step 3's
   NCCL broadcast of the same bytes (--cpu: a memfd region against gloo between the same processes);
5. (2 GPUs) LoRA: an adapter-only version (r = 16 on every matrix of step 3's state) published and
   applied by the subscriber (base + B @ A), its bytes and time against the full publish.

Each role is its own process (this file with --role), given one GPU through CUDA_VISIBLE_DEVICES
and a deadline; NCCL refuses two ranks on one GPU, so with one GPU step 3 is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(role: str, ranks: int, args, extra_env: dict | None = None, relay: bool = False,
           same_device: bool = False) -> list[dict]:
    """Run `ranks` processes of `role`; each prints JSON lines; returns every rank's last line."""
    port, procs = _free_port(), []
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    for r in range(ranks):
        env = {**os.environ, **(extra_env or {}), "RANK": str(r), "WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": ROOT}
        if not args.cpu:
            g = 0 if same_device else r  # our logical GPU r, one per rank (or all on the first)
            env["CUDA_VISIBLE_DEVICES"] = visible[g] if visible else str(g)
        procs.append(subprocess.Popen([sys.executable, __file__, "--role", role, "--mb", str(args.mb)]
                                      + (["--cpu"] if args.cpu else []) + (["--lora"] if args.lora else []),
                                      env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    try:
        if relay:  # rank 0's first line (the publisher's store address) goes to rank 1
            procs[1].stdin.write(procs[0].stdout.readline())
            procs[1].stdin.flush()
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"{role} rank {r} failed with exit code {p.returncode}; its stderr is above")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def train(args) -> None:
    """One rank of a data-parallel actor; rank 0 prints step time and the gap to a 1-rank run."""
    import torch
    import torch.distributed as dist

    from flowrl.models import TinyLMSpec, build_model
    from flowrl.rl import ActorConfig, ActorTrainer
    from flowrl.rl.parallel import full_state_items

    device = "cpu" if args.cpu else "cuda:0"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo" if args.cpu else "nccl", device_id=None if args.cpu else torch.device(device))
    d, n, L = (32, 2, 16) if args.cpu else (512, 8, 256)  # --cpu: a smoke test, kept small
    spec = TinyLMSpec(d_model=d, n_layers=n, n_heads=4, max_seq_len=L)
    cfg = ActorConfig(lr=1e-3, mini_batches=2, epochs=2)
    g = torch.Generator().manual_seed(0)
    B, T = 32, L * 3 // 4
    batches = [dict(tokens=torch.randint(0, spec.vocab_size, (B, L), generator=g), prompt_len=L - T,
                    response_mask=torch.ones(B, T, dtype=torch.bool), old_logprobs=-torch.rand(B, T, generator=g) * 3,
                    advantages=torch.randn(B, generator=g)) for _ in range(3)]
    shard = lambda b: {k: (v[rank * B // world:(rank + 1) * B // world] if torch.is_tensor(v) else v)  # noqa: E731
                       for k, v in b.items()}
    actor = ActorTrainer(build_model(spec, seed=0).to(device), cfg, seed=0)
    times, metrics = [], {}
    for b in batches:
        t0 = time.perf_counter()
        metrics = actor.train_step(**shard(b))
        if not args.cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    full = {k: v.float().cpu().clone() for k, v in full_state_items(actor.model)}  # every rank takes part
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        ref = ActorTrainer(build_model(spec, seed=0).to(device), cfg, seed=0)
        for b in batches:
            ref.train_step(**b)
        flat = lambda sd: torch.cat([v.float().cpu().reshape(-1) for v in sd.values()])  # noqa: E731
        want = flat(ref.model.state_dict())
        gap = float((flat(full) - want).norm() / want.norm())
        print(json.dumps({"ranks": world, "step_s": min(times[1:]), "policy_loss": metrics["policy_loss"],
                          "relative_gap_to_1_rank": gap}), flush=True)
    else:
        print(json.dumps({"rank": rank}), flush=True)


def state_dict(mb: int, device: str):
    """Transformer-like fp32 tensors adding up to about `mb` MiB, the same in every process."""
    import torch

    d, out, i, g = (1024 if mb >= 64 else 128), {}, 0, torch.Generator().manual_seed(0)
    while sum(t.numel() * 4 for t in out.values()) < mb << 20:
        for name, shape in ((f"l{i}.qkv", (3 * d, d)), (f"l{i}.up", (4 * d, d)), (f"l{i}.norm", (d,))):
            out[name] = torch.randn(shape, generator=g).to(device)
        i += 1
    return out


def adapters_of(sd: dict, r: int = 16) -> dict:
    """LoRA adapters (flowrl.weights.adapters: `P.lora_A` [r, in], `P.lora_B` [out, r]) of every 2-D weight."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = {}
    for name, w in sd.items():
        if w.dim() == 2:
            stem = name.removesuffix(".weight")
            out[f"{stem}.lora_A"] = (torch.randn(r, w.shape[1], generator=g) * 0.01).to(w.device)
            out[f"{stem}.lora_B"] = (torch.randn(w.shape[0], r, generator=g) * 0.01).to(w.device)
    return out


def sync(args) -> None:
    """Publisher (rank 0) or subscriber (rank 1): raw broadcast, then flowrl's publish, timed. With
    --lora the publisher sends adapter versions only and the subscriber applies them (base + B @ A)."""
    import torch

    from flowrl.weights import WeightGroup, WeightPublisher, WeightSubscriber
    from flowrl.weights.store import connect

    device, rank, secret = ("cpu" if args.cpu else "cuda:0"), int(os.environ["RANK"]), os.environ["GPU_CHECK_SECRET"]
    sd = state_dict(args.mb, device)
    sent = {f"{k}.weight": v for k, v in sd.items()} if args.lora else sd  # adapters name the weights they adapt
    sd = adapters_of(sent) if args.lora and rank == 0 else sent
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    if rank == 0:
        pub = WeightPublisher(lambda: sd, device=device, secret=secret)
        addr = pub.store_addr
        print(json.dumps({"addr": addr}), flush=True)
    else:
        addr = tuple(json.loads(sys.stdin.readline())["addr"])
        base = {k: (v.clone() if args.lora else torch.zeros_like(v)) for k, v in sd.items()}  # --lora: adapters apply to it
        sub = WeightSubscriber(base, device=device)
        sub.join(1, 1, 2, addr, secret, timeout_s=TIMEOUT_S, ready_timeout_s=TIMEOUT_S)
    raw = WeightGroup.join(epoch=0, rank=rank, world_size=2, store=connect(addr, secret).child("raw"),
                           timeout_s=TIMEOUT_S, device=device)
    flat = torch.zeros(nbytes // 4, device=device)
    done = (lambda: None) if device == "cpu" else torch.cuda.synchronize  # NCCL returns before the GPU is done

    def together() -> None:  # both ranks are here, nothing in flight: the timed part starts together
        raw.broadcast([torch.ones(1, device=device)])
        done()

    res = {"raw": [], "publish": []}
    for rep in range(4):  # rep 0 warms up (group forming, first touch)
        together()
        t0 = time.perf_counter()
        raw.broadcast([flat])
        done()
        raw_s = time.perf_counter() - t0
        if rank == 0:
            pub.snapshot(rep + 1)
        together()
        t0 = time.perf_counter()
        if rank == 0:
            pub.serve(1, 2, timeout_s=TIMEOUT_S, ready_timeout_s=TIMEOUT_S)
        else:
            assert sub.receive() == rep + 1, "subscriber got another version than the publisher sent"
        done()
        if rep:
            res["raw"].append(raw_s)
            res["publish"].append(time.perf_counter() - t0)
    if args.lora and rank == 1:
        from flowrl.weights.adapters import merged

        want = merged(sent, adapters_of(sent))
        ok = all(torch.equal(sub.live[k], v) for k, v in want.items())
        nbytes = sum(t.numel() * t.element_size() for t in adapters_of(sent).values())
    else:
        ok = rank == 0 or all(torch.equal(sub.live[k], v) for k, v in sd.items())
    print(json.dumps({"rank": rank, "mb": nbytes / 2**20, "bitwise": ok, **{k: min(v) for k, v in res.items()}}),
          flush=True)


def sleep_wake(args) -> tuple:
    """A trainer's state offloaded between turns and back: device memory released, values bitwise."""
    import torch

    from flowrl.rl.offload import Offload, trainer_tensors

    device = "cpu" if args.cpu else "cuda:0"
    model = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(max(1, args.mb // 16))).to(device)
    opt = torch.optim.AdamW(model.parameters())
    sum(layer(torch.ones(2, 1024, device=device)).sum() for layer in model).backward()
    opt.step()
    before = {k: v.clone() for k, v in trainer_tensors(model, opt).items()}
    used = (lambda: torch.cuda.memory_allocated()) if device != "cpu" else (lambda: 0)
    a = used()
    import tempfile

    off = Offload(os.path.join(tempfile.mkdtemp(prefix="gpu_check-"), "sleep.pt"))
    t0 = time.perf_counter()
    off.put(trainer_tensors(model, opt))
    sleep_s, b = time.perf_counter() - t0, used()
    t0 = time.perf_counter()
    off.take()
    wake_s = time.perf_counter() - t0
    same = all(torch.equal(before[k], v) for k, v in trainer_tensors(model, opt).items())
    return ("sleep / wake", f"{sum(v.numel() * v.element_size() for v in before.values()) / 2**20:.0f} MiB state",
            f"{sleep_s * 1e3:.0f} / {wake_s * 1e3:.0f} ms",
            f"allocated {a / 2**20:.0f} -> {b / 2**20:.0f} MiB, bitwise={same}")


def handoff(args) -> None:
    """Publisher (rank 0) and subscriber (rank 1) on ONE device: flowrl.weights.handoff (a CUDA IPC
    handle on a GPU, a memfd region on CPU), then (CPU only: NCCL refuses two ranks on one GPU) the
    broadcast between the same two processes. Per version: from the go until the version is live in
    the subscriber (its copy out of the region / staging included)."""
    import torch

    from flowrl.weights.handoff import SharedPublisher, SharedSubscriber

    device, rank, secret = ("cpu" if args.cpu else "cuda:0"), int(os.environ["RANK"]), os.environ["GPU_CHECK_SECRET"]
    sd = state_dict(args.mb, device)
    modes = [("handoff", True)] + ([("broadcast", False)] if args.cpu else [])
    if rank == 0:
        pub = SharedPublisher(lambda: sd, device=device, secret=secret, region_name="flowrl-gpu-check")
        pub.snapshot(0)
        print(json.dumps({"addr": pub.store_addr}), flush=True)
        res = {}
        for epoch, (name, on) in enumerate(modes, start=1):
            times = []
            for rep in range(4):  # rep 0 warms up (the region's first map, the group's forming)
                pub.snapshot(rep + 1)
                pub.serve(epoch, 2, timeout_s=TIMEOUT_S, ready_timeout_s=TIMEOUT_S, handoff=on)
                times.append(pub.seconds)
            res[name] = times[1:]
        print(json.dumps({"rank": 0, **res}), flush=True)
        pub.close()
        return
    addr = tuple(json.loads(sys.stdin.readline())["addr"])
    sub = SharedSubscriber({k: torch.zeros_like(v) for k, v in sd.items()}, device=device)
    res, ok = {}, True
    for epoch, (name, on) in enumerate(modes, start=1):
        sub.join(epoch, 1, 2, addr, secret, timeout_s=TIMEOUT_S, ready_timeout_s=TIMEOUT_S, handoff=on)
        res[name] = []
        for rep in range(4):
            assert sub.receive() == rep + 1, "subscriber got another version than the publisher sent"
            res[name].append(0.0 if on else sub.commit_seconds)  # a handoff's publisher time includes the copy
            ok = ok and all(torch.equal(sub.live[k], v) for k, v in state_dict(args.mb, device).items()) \
                if rep == 3 and name == "handoff" else ok
        res[name] = res[name][1:]
    print(json.dumps({"rank": 1, "bitwise": ok, "mb": sum(t.numel() * 4 for t in sd.values()) / 2**20, **res}),
          flush=True)
    sub.close()


def ipc_handoff(args) -> tuple[dict, dict]:
    """The publisher's and the subscriber's results of `handoff` (two processes on one device)."""
    pub, sub = _spawn("handoff", 2, args, {"GPU_CHECK_SECRET": secrets.token_hex(32)}, relay=True, same_device=True)
    return pub, sub


def inventory(args) -> list[str]:
    if args.cpu:
        return ["(--cpu: no GPU inventory; gloo on CPU cores)"]
    from flowrl.placement.nvml import NvmlInventory

    inv = NvmlInventory.probe()
    if inv is None:
        return ["NVML: not available (no driver library, or no GPU it can see)"]
    lines = [f"NVML: {inv.describe()}"]
    for host in inv.hosts:
        lines.append(f"  {host.name}: {host.mapping_text()}")
        for d in host.visible_devices():
            lines.append(f"  {d.label()}  uuid={d.uuid} pcie_root={d.pcie_root} numa={d.numa_node} "
                         f"nvlink_peers={sorted(d.nvlink_peers)} foreign_processes={len(d.processes)}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512, help="MiB of fp32 weights to publish (default 512)")
    ap.add_argument("--cpu", action="store_true", help="run the same code over gloo on CPU (a smoke test)")
    ap.add_argument("--role", choices=["train", "sync", "handoff"], help=argparse.SUPPRESS)
    ap.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)  # the sync role sends adapters
    args = ap.parse_args()
    if args.role:
        {"train": train, "sync": sync, "handoff": handoff}[args.role](args)
        return 0
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device is visible (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}). Run it on a GPU machine, or with --cpu for the gloo path.")
        return 0
    gpus = 2 if args.cpu else torch.cuda.device_count()
    print("\n".join(inventory(args)))
    ranks = 2 if gpus >= 2 else 1
    t = _spawn("train", ranks, args)[0]
    rows = [("DP actor step", f"{t['ranks']} rank(s), {'gloo' if args.cpu else 'NCCL'}", f"{t['step_s'] * 1e3:.1f} ms",
             f"params vs 1 rank: {t['relative_gap_to_1_rank']:.1e} relative")]
    if gpus >= 2:
        _, sub = _spawn("sync", 2, args, {"GPU_CHECK_SECRET": secrets.token_hex(32)}, relay=True)
        gb = sub["mb"] / 1024
        rows.append(("raw broadcast", f"{sub['mb']:.0f} MiB", f"{sub['raw'] * 1e3:.1f} ms", f"{gb / sub['raw']:.1f} GiB/s"))
        rows.append(("weight publish", f"{sub['mb']:.0f} MiB", f"{sub['publish'] * 1e3:.1f} ms",
                     (f"{gb / sub['publish']:.1f} GiB/s, {sub['publish'] / sub['raw']:.2f}x raw, "
                      f"bitwise={sub['bitwise']}")))
        args.lora = True
        _, lora = _spawn("sync", 2, args, {"GPU_CHECK_SECRET": secrets.token_hex(32)}, relay=True)
        args.lora = False
        rows.append(("LoRA adapter sync", f"r=16: {lora['mb']:.1f} MiB ({lora['mb'] / sub['mb']:.1%})",
                     f"{lora['publish'] * 1e3:.1f} ms", (f"{lora['publish'] / sub['publish']:.3f}x the full publish, "
                                                        f"applied bitwise={lora['bitwise']}")))
    else:
        rows.append(("weight publish", "skipped", "", "needs 2 GPUs: NCCL refuses two ranks on one GPU"))
    rows.append(sleep_wake(args))
    hp, hs = ipc_handoff(args)
    mib, ipc_s = hs["mb"], min(hp["handoff"])
    vs = f", {sub['raw'] / ipc_s:.1f}x faster than the NCCL broadcast" if gpus >= 2 and not args.cpu else ""
    rows.append(("CUDA IPC handoff" if not args.cpu else "memfd handoff", f"{mib:.0f} MiB, one device",
                 f"{ipc_s * 1e3:.1f} ms", f"{mib / 1024 / ipc_s:.1f} GiB/s, bitwise={hs['bitwise']}{vs}"))
    if "broadcast" in hp:  # --cpu: the gloo broadcast between the same two processes, its copy-out included
        b_s = min(p + c for p, c in zip(hp["broadcast"], hs["broadcast"]))
        rows.append(("gloo broadcast", f"{mib:.0f} MiB, one device", f"{b_s * 1e3:.1f} ms",
                     f"{mib / 1024 / b_s:.1f} GiB/s; the handoff is {b_s / ipc_s:.1f}x faster"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in [("check", "setup", "time", "result"), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
