"""Weight sync cost vs a raw gloo broadcast of the same bytes, between two real processes.

    python benchmarks/weight_sync.py                 # 60 MB and 400 MB state dicts
    python benchmarks/weight_sync.py --sizes-mb 60 --reps 3 --json out.json

flowrl's path, timed on the receiving side: `WeightSubscriber.receive()` on an nn.Module (say
ready, wait for the go, receive every 32 MiB bucket (the last carries the version) into the idle half of
the double buffer, then point the module's tensors at it), against a `WeightPublisher` that
serves a snapshot of a state dict of many tensors (a transformer's shapes). The raw baseline
broadcasts one flat tensor of the same bytes over a gloo group on the same loopback address.
`copy s` is what a subscriber given a dict of tensors (copy mode) adds: one copy of the whole
version out of staging; `snapshot s` is the publisher's copy out of training. Target: sync/raw
<= 1.3x.

Adapter versions (LoRA), the second table: a Llama of SmolLM2-135M's shape (random weights, written
to a temporary folder) in a rollout engine of its own process; the trainer's process publishes
the full state and, on a second publisher, only r=16 adapters of q, k, v and o. `land s` is what a
rollout waits for a version: receive it (broadcast) and load it into the engine (`load_weights`:
the hf engine writes base + B @ A in place; `vllm` (engine `lora: merge`) merges and reloads only
those layers; `vllm-serve` (`lora: serve`) writes the adapters into vLLM's LoRA slot). The vLLM rows
need vllm importable (run the script with the vLLM environment's python); else they say skipped.
Targets: adapter bytes <= 2% of the full state; vLLM adapter land <= 0.1x a full one. `decode
tok/s` (vLLM rows): generation with the adapter version applied, 64 prompts x 16 new tokens,
sampled -- what serving the adapter costs each step against decoding merged weights.

    python benchmarks/weight_sync.py --sizes-mb --engines hf vllm vllm-serve   # only the adapter table
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import subprocess
import sys
import time

BUCKET = 32 << 20


def state_dict(mb: int):
    """Transformer-like shapes adding up to about `mb` MiB of float32."""
    import torch

    d = 1024
    out, total, i = {}, 0, 0
    target = mb << 20
    while total < target:
        for name, shape in ((f"l{i}.qkv", (3 * d, d)), (f"l{i}.proj", (d, d)), (f"l{i}.up", (4 * d, d)),
                            (f"l{i}.down", (d, 4 * d)), (f"l{i}.norm", (d,))):
            t = torch.randn(shape)
            out[name] = t
            total += t.numel() * 4
            if total >= target:
                break
        i += 1
    return out


def module_of(tensors: dict):
    import torch

    root = torch.nn.Module()
    for name, t in tensors.items():
        layer, leaf = name.split(".")
        if not hasattr(root, layer):
            root.add_module(layer, torch.nn.Module())
        getattr(root, layer).register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def barrier(store, name: str, rank: int) -> None:
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{1 - rank}"], datetime.timedelta(seconds=300))


def worker(rank: int, mb: int, reps: int, secret: str) -> None:
    import torch

    from flowrl.weights import WeightGroup, WeightPublisher, WeightSubscriber
    from flowrl.weights.store import connect

    torch.set_num_threads(1)
    sd = state_dict(mb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    flat = torch.empty(nbytes // 4)
    if rank == 0:
        pub = WeightPublisher(lambda: sd, bucket_bytes=BUCKET, secret=secret)
        print(json.dumps({"addr": pub.store_addr}), flush=True)
        addr = pub.store_addr
    else:
        addr = tuple(json.loads(sys.stdin.readline())["addr"])
        sub = WeightSubscriber(module_of(sd), bucket_bytes=BUCKET)  # swap: sd's storage is the module's until v0
        sub.join(1, 1, 2, addr, secret, timeout_s=300, ready_timeout_s=300)
        copy_target = {k: torch.empty_like(v) for k, v in sd.items()}
    store = connect(addr, secret, timeout_s=300)
    raw = WeightGroup.join(epoch=0, rank=rank, world_size=2, store=store.child("raw"), timeout_s=300)
    results = {"raw": [], "sync": [], "copy": [], "snapshot": []}
    for rep in range(reps + 1):  # the first is a warm-up (group forming, first touch of the buffers)
        barrier(store, f"raw-{rep}", rank)
        t0 = time.perf_counter()
        raw.broadcast([flat])
        raw_s = time.perf_counter() - t0
        if rank == 0:
            t0 = time.perf_counter()
            pub.snapshot(rep)
            snap_s = time.perf_counter() - t0
        barrier(store, f"sync-{rep}", rank)
        t0 = time.perf_counter()
        if rank == 0:
            pub.serve(1, 2, timeout_s=300, ready_timeout_s=300)
        else:
            assert sub.receive() == rep
        sync_s = time.perf_counter() - t0
        if rep:
            results["raw"].append(raw_s)
            results["sync"].append(sync_s)
            if rank == 0:
                results["snapshot"].append(snap_s)
            else:
                t0 = time.perf_counter()
                for i in range(len(sub.plan)):  # what copy mode (a dict target) does after the broadcast
                    sub.plan.unpack(i, sub._serving, copy_target)
                results["copy"].append(time.perf_counter() - t0)
    print(json.dumps({"rank": rank, "mb": nbytes / 2**20, **results}), flush=True)


SMOLLM_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_llama(folder: str, dtype: str) -> None:
    """SmolLM2-135M's shape, random init, with the character tokenizer of examples/hf_tiny."""
    from pathlib import Path

    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.hf_tiny.make_model import write_tokenizer

    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM_135M, torch_dtype=dtype))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    write_tokenizer(Path(folder))


def adapters_of(weights: dict, rank: int, seed: int) -> dict:
    """An adapter version: `P.lora_A` [r, in], `P.lora_B` [out, r] for q, k, v and o of every layer."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        if name.endswith(".weight") and any(f".{t}." in name for t in ATTENTION):
            stem = name[: -len(".weight")]
            out[stem + ".lora_A"] = (torch.randn(rank, w.shape[1], generator=g) * 0.01).to(w.dtype)
            out[stem + ".lora_B"] = (torch.randn(w.shape[0], rank, generator=g) * 0.01).to(w.dtype)
    return out


def adapter_worker(rank: int, folder: str, engine_type: str, reps: int, r: int, dtype: str, secret: str) -> None:
    """Rank 0 publishes full and adapter versions (two publishers); rank 1 is a rollout engine."""
    import torch

    from flowrl.weights import WeightPublisher, WeightSubscriber
    from flowrl.weights.store import connect

    torch.set_num_threads(1)
    if rank == 0:
        from flowrl.models import build_model

        full = {k: v.detach() for k, v in build_model({"type": "hf", "path": folder}).to(getattr(torch, dtype))
                .state_dict().items()}
        adapters = adapters_of(full, r, 0)
        pubs = [WeightPublisher(lambda: full, bucket_bytes=BUCKET, secret=secret),
                WeightPublisher(lambda: adapters, bucket_bytes=BUCKET, secret=secret)]
        print(json.dumps({"addrs": [p.store_addr for p in pubs]}), flush=True)
        addrs = [p.store_addr for p in pubs]
    else:
        from flowrl.engines import build_engine

        spec = {"type": engine_type.split("-")[0]}
        if engine_type.startswith("vllm"):
            spec.update(kv_cache_memory_bytes=64 << 20, max_model_len=256)
        if engine_type == "vllm-serve":
            spec.update(lora="serve", max_lora_rank=max(16, r))
        engine = build_engine(spec, model={"type": "hf", "path": folder}, device="cpu", dtype=dtype, seed=0)
        addrs = [tuple(a) for a in json.loads(sys.stdin.readline())["addrs"]]
        subs = [WeightSubscriber(engine.weights(), bucket_bytes=BUCKET, version=0, apply_adapters=False)
                for _ in addrs]  # as the rollout's: the engine applies adapter versions itself
        for sub, addr in zip(subs, addrs):
            sub.join(1, 1, 2, addr, secret, timeout_s=600, ready_timeout_s=600)
    store = connect(addrs[0], secret, timeout_s=600)
    results = {"full": [], "adapter": [], "full_bcast": [], "adapter_bcast": []}
    for rep in range(reps + 1):  # the first is a warm-up
        for kind, i in (("full", 0), ("adapter", 1)):
            if rank == 0:
                pubs[i].snapshot(rep + 1)
            barrier(store, f"{kind}-{rep}", rank)
            t0 = time.perf_counter()
            if rank == 0:
                pubs[i].serve(1, 2, timeout_s=600, ready_timeout_s=600)
                continue
            version = subs[i].receive()
            engine.load_weights(subs[i].received().items(), version)
            if rep:
                results[kind].append(time.perf_counter() - t0)
                results[f"{kind}_bcast"].append(subs[i].seconds)
    if rank == 1:
        nbytes = [sub.plan.nbytes(sub.staging) for sub in subs]
        decode = decode_rate(engine) if engine_type.startswith("vllm") else None  # the adapter version applied
        print(json.dumps({"full_bytes": nbytes[0], "adapter_bytes": nbytes[1], "decode_tok_s": decode, **results}),
              flush=True)
        engine.close()


def decode_rate(engine, prompts: int = 64, new_tokens: int = 16, reps: int = 2) -> float:
    """Generated tokens per second: `prompts` prompts of 16 tokens, `new_tokens` sampled each (best of `reps`)."""
    import torch

    from flowrl.engines import Sampling
    from flowrl.transport.ragged import Ragged

    g = torch.Generator().manual_seed(0)
    batch = Ragged.from_sequences([torch.randint(3, 60, (16,), generator=g).tolist() for _ in range(prompts)])
    sampling = Sampling(n=1, temperature=1.0, max_new_tokens=new_tokens, eos_id=-1, pad_id=0)
    engine.generate(batch.select(slice(0, 4)), sampling, seed=0)  # warm-up
    best = 0.0
    for rep in range(reps):
        t0 = time.perf_counter()
        out = engine.generate(batch, sampling, seed=rep)
        best = max(best, int(out.response_lens.sum()) / (time.perf_counter() - t0))
    return best


def measure_adapters(engine_type: str, folder: str, reps: int, r: int, dtype: str) -> dict:
    import importlib.util

    if engine_type.startswith("vllm") and importlib.util.find_spec("vllm") is None:
        return {"engine": engine_type, "skipped": "vllm is not importable here (run with the vLLM env's python)"}
    secret = secrets.token_hex(32)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWRL_BENCH_SECRET": secret}
    args = [folder, engine_type, str(reps), str(r), dtype]
    procs = [subprocess.Popen([sys.executable, __file__, "--adapter-worker", str(k), *args], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for k in range(2)]
    try:
        procs[1].stdin.write(procs[0].stdout.readline())  # the publishers' store addresses
        procs[1].stdin.flush()
        out = procs[1].communicate(timeout=1800)[0]
        procs[0].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    sub = json.loads(out.strip().splitlines()[-1])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"engine": engine_type, "full_mb": sub["full_bytes"] / 2**20, "adapter_mb": sub["adapter_bytes"] / 2**20,
            "bytes_pct": 100 * sub["adapter_bytes"] / sub["full_bytes"], "full_s": med(sub["full"]),
            "adapter_s": med(sub["adapter"]), "full_bcast_s": med(sub["full_bcast"]),
            "adapter_bcast_s": med(sub["adapter_bcast"]), "time_ratio": med(sub["adapter"]) / med(sub["full"]),
            "decode_tok_s": sub["decode_tok_s"]}


def print_adapter_rows(rows: list[dict], r: int, dtype: str) -> None:
    print(f"\nadapter (r={r}, q/k/v/o) vs full version, SmolLM2-135M shape, {dtype}; land = broadcast + load")
    print(f"{'engine':>10} {'full MB':>8} {'adapter MB':>11} {'bytes %':>8} {'full land s':>12} "
          f"{'adapter land s':>15} {'time ratio':>11} {'full bcast s':>13} {'adapter bcast s':>16} {'decode tok/s':>13}")
    for x in rows:
        if "skipped" in x:
            print(f"{x['engine']:>10} skipped: {x['skipped']}")
            continue
        decode = "-" if x.get("decode_tok_s") is None else f"{x['decode_tok_s']:.0f}"
        print(f"{x['engine']:>10} {x['full_mb']:>8.1f} {x['adapter_mb']:>11.2f} {x['bytes_pct']:>7.2f}% "
              f"{x['full_s']:>12.3f} {x['adapter_s']:>15.3f} {x['time_ratio']:>10.3f}x {x['full_bcast_s']:>13.3f} "
              f"{x['adapter_bcast_s']:>16.4f} {decode:>13}")


def measure(mb: int, reps: int) -> dict:
    secret = secrets.token_hex(32)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWRL_BENCH_SECRET": secret}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(mb), str(reps)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        procs[1].stdin.write(procs[0].stdout.readline())  # the publisher's store address
        procs[1].stdin.flush()
        out = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    pub, sub = (json.loads(o.strip().splitlines()[-1]) for o in out)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    raw, sync, copy, snap = med(sub["raw"]), med(sub["sync"]), med(sub["copy"]), med(pub["snapshot"])
    return {"state_dict_mb": round(sub["mb"], 1), "raw_s": raw, "sync_s": sync, "copy_s": copy, "snapshot_s": snap,
            "raw_gbps": sub["mb"] / 1024 / raw, "ratio": sync / raw, "ratio_with_snapshot": (sync + snap) / raw}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), os.environ["FLOWRL_BENCH_SECRET"])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--adapter-worker":
        k, folder, engine_type, reps, r, dtype = sys.argv[2:8]
        adapter_worker(int(k), folder, engine_type, int(reps), int(r), dtype, os.environ["FLOWRL_BENCH_SECRET"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="*", default=[60, 400])
    ap.add_argument("--engines", nargs="*", default=["hf", "vllm", "vllm-serve"],
                    choices=["builtin", "hf", "vllm", "vllm-serve"],
                    help="rollout engines of the adapter table (vllm: lora merge, vllm-serve: lora serve; "
                         "none: no adapter table)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of the adapter versions")
    ap.add_argument("--dtype", default="bfloat16", help="the engines' and versions' dtype")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rows = [measure(mb, args.reps) for mb in args.sizes_mb]
    adapter_rows = []
    if args.engines:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            write_llama(folder, args.dtype)
            adapter_rows = [measure_adapters(e, folder, args.reps, args.rank, args.dtype) for e in args.engines]
    print(f"{'state dict':>11} {'raw gloo s':>11} {'sync s':>8} {'sync/raw':>9} {'copy s':>7} {'snapshot s':>11} "
          f"{'(snap+sync)/raw':>16} {'raw GB/s':>9}")
    for r in rows:
        print(f"{r['state_dict_mb']:>8.1f} MB {r['raw_s']:>11.3f} {r['sync_s']:>8.3f} {r['ratio']:>8.2f}x "
              f"{r['copy_s']:>7.3f} {r['snapshot_s']:>11.3f} {r['ratio_with_snapshot']:>15.2f}x {r['raw_gbps']:>9.2f}")
    if adapter_rows:
        print_adapter_rows(adapter_rows, args.rank, args.dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"full": rows, "adapters": adapter_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
