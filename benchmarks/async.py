"""Sample-level asynchrony on the long-tail task: what each step adds, measured in one run.

    python benchmarks/async.py                     # 4 rows x 60 updates, builtin engine (a few minutes)
    python benchmarks/async.py --quick             # 20 updates each
    python benchmarks/async.py --engine all        # builtin and vLLM's CPU build (skipped if not importable)
    python benchmarks/async.py --json out.json

Every row is a real `flowrl run` of graphs/grpo-longtail.yaml (GRPO on `longtail`: answers of 1-200
tokens, median 8) in a child process with its own process group, in a temporary run directory,
killed by that group's id if it outlives `--timeout`. The graph file is read, its four asynchrony
settings are taken out (the per-ticket pipeline of today), and each row puts back what it tests as
command-line overrides, the same number of updates (so of completions) each:

  (a) per-ticket        one ticket = `batch_size` prompts = one update; batch-at-a-time generation;
                        max_staleness 1
  (b) continuous        + rollout `concurrency: N`, engine `continuous: true` (iteration-level
                        batching across tickets, `max_num_seqs`), `on_new_weights: finish`
  (c) + group tickets   + `schedule.ticket: group` (a prompt group leaves the rollout when its
                        samples are done; an update takes `batch_size` groups)
  (d) + partial         + `on_new_weights: keep` (a version lands mid-generation; sequences go on)

Columns, over the updates after the first `--warmup` (start-up excluded), from the run's own
metrics.jsonl and ledger:

  completions/s   samples trained on / wall seconds
  rollout busy    the rollout's `rollout_busy` gauge (the engine generating) where the node records
                  it, else its `compute` spans' share of wall time (`rollout/compute_ratio`)
  trainer wait    the actor's share of wall time waiting for input (`wait_input`) or inside a weight
                  sync waiting for the rollout to join it (`weight_sync`: a rollout inside a
                  batch-at-a-time call joins only between calls), and seconds of it per update
  staleness held  % of consumed tickets (groups, with `ticket: group`) whose staleness is
                  <= max_staleness, from the ledger's `consumed` events
  speedup         completions/s over row (a)'s

A row whose settings the runtime does not know yet fails at load ("Extra inputs are not
permitted"); the table is printed for the rows that ran and names the ones that failed, and why.
Targets: (d) >= 2x (a) in completions/s; rollout busy >= 80%; staleness held for 100% of groups.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GRAPH = ROOT / "graphs" / "grpo-longtail.yaml"
MAX_STALENESS = 1
VLLM_ENGINE = {"type": "vllm", "kv_cache_memory_bytes": 128 << 20}


def yaml_model_len(graph: Path) -> int:
    """The vLLM engine's max_model_len in a graph written by `per_ticket_graph`."""
    import yaml

    return yaml.safe_load(graph.read_text())["nodes"]["rollout"]["config"]["engine"]["max_model_len"]


@dataclass
class Config:
    key: str
    label: str
    overrides: list[str] = field(default_factory=list)


def configs(concurrency: int, max_num_seqs: int, engine: dict) -> list[Config]:
    """The four rows, each the one before it plus one setting."""
    cont = json.dumps({**engine, "continuous": True, "max_num_seqs": max_num_seqs})
    b = [f"nodes.rollout.concurrency={concurrency}", f"nodes.rollout.config.engine={cont}",
         "schedule.ticket=batch", "nodes.rollout.config.on_new_weights=finish"]
    c = [*b, "schedule.ticket=group"]
    d = [*c, "nodes.rollout.config.on_new_weights=keep"]
    return [Config("a", "(a) per-ticket"), Config("b", f"(b) continuous, concurrency {concurrency}", b),
            Config("c", "(c) + group tickets", c), Config("d", "(d) + partial rollouts", d)]


def per_ticket_graph(out: Path, engine: str, hf_model: Path | None, model: dict | None = None) -> Path:
    """graphs/grpo-longtail.yaml without its asynchrony settings (what row (a) runs; the others add
    theirs back as overrides), written to ``out``; for vLLM, with a Hugging Face model and engine;
    for the builtin engine, with ``model`` settings over the graph's tiny model (rollout and actor)."""
    import yaml

    g = yaml.safe_load(GRAPH.read_text())
    g.pop("vars", None)  # its anchors are resolved by now
    if model and engine == "builtin":
        for name in ("rollout", "actor"):
            g["nodes"][name]["config"]["model"] = {**g["nodes"][name]["config"]["model"], **model}
    rollout = g["nodes"]["rollout"]
    rollout.pop("concurrency", None)
    rollout["config"].pop("on_new_weights", None)
    rollout["config"]["engine"] = {"type": "builtin"}
    g["schedule"].pop("ticket", None)
    g["schedule"]["max_staleness"] = MAX_STALENESS
    g["schedule"]["checkpoint_every"] = 0
    if engine == "vllm":
        seq = g["nodes"]["rollout"]["config"]["model"]["max_seq_len"]
        model = {"type": "hf", "path": str(hf_model)}
        for name in ("rollout", "actor"):
            g["nodes"][name]["config"]["model"] = dict(model)
        rollout["config"]["engine"] = {**VLLM_ENGINE, "max_model_len": seq, "continuous": False}
    out.write_text(yaml.safe_dump(g, sort_keys=False))
    return out


def failure(stderr: str) -> str:
    """The line of a failed run that says why: the keys this runtime does not know, else the error."""
    unknown = list(dict.fromkeys(re.findall(r"([\w.]+): Extra inputs are not permitted", stderr)))
    if unknown:
        return f"keys this runtime does not know yet: {', '.join(unknown)}"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for pattern in (r"problem", r"Error|error"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "no output"


def weighted(rows: list[dict], key: str) -> float | None:
    """Mean of a per-row ratio over the measured rows, weighted by each row's step time."""
    pairs = [(r[key], r["step_time_s"]) for r in rows if r.get(key) is not None and r.get("step_time_s")]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def busy_key(rows: list[dict]) -> str:
    keys = set().union(*(r.keys() for r in rows))
    gauges = sorted(k for k in keys if k.split("/")[-1].startswith("rollout_busy"))
    return gauges[0] if gauges else "rollout/compute_ratio"


def measure(result, warmup: int) -> dict:
    m = sorted(result.metrics, key=lambda r: r["step"])
    if len(m) <= warmup + 1:
        raise ValueError(f"only {len(m)} updates recorded; need more than --warmup {warmup} + 1")
    start, rows = m[warmup - 1] if warmup else {"wall_s": 0.0}, m[warmup:]
    seconds = rows[-1]["wall_s"] - start["wall_s"]
    completions = sum(int(r.get("samples", 0)) for r in rows)
    busy = busy_key(rows)
    for r in rows:  # the trainer waits for input, or inside a weight sync for the rollout to join it
        r["actor/waiting_ratio"] = r.get("actor/wait_input_ratio", 0.0) + r.get("actor/weight_sync_ratio", 0.0)
    wait = weighted(rows, "actor/waiting_ratio")
    consumed = [e for e in result.ledger if e.get("event") == "consumed" and e.get("node", "actor") == "actor"
                and "staleness" in e]
    held = sum(e["staleness"] <= MAX_STALENESS for e in consumed)
    return {
        "updates": len(rows), "completions": completions, "seconds": seconds,
        "completions_per_s": completions / seconds,
        "generated_tokens_per_s": sum(r.get("rollout_tokens_generated") or 0 for r in rows) / seconds,
        "rollout_busy": weighted(rows, busy), "busy_source": busy,
        "trainer_wait": wait,
        "trainer_wait_s_per_update": (sum(r["actor/waiting_ratio"] * r["step_time_s"] for r in rows)
                                      / len(rows)),
        "staleness_held": held / len(consumed) if consumed else None,
        "staleness_seen_max": max((e["staleness"] for e in consumed), default=None),
        "groups": len(consumed),
        "reward_last": sum(r["reward_mean"] for r in m[-10:]) / len(m[-10:]),
    }


def run_rows(engine: str, args, workdir: Path) -> list[dict]:
    from flowrl.testing import run_graph

    hf_model = None
    if engine == "vllm":
        from examples.hf_tiny.make_model import write_model

        hf_model = write_model(workdir / "hf-tiny-256", "tiny", max_len=256)
    graph = per_ticket_graph(workdir / f"per-ticket-{engine}.yaml", engine, hf_model, parse_model(args.model))
    engine_spec = {"type": engine}
    if engine == "vllm":  # (b)-(d) replace the engine mapping: the same cache and context as (a)
        seq = yaml_model_len(graph)
        engine_spec = {**VLLM_ENGINE, "max_model_len": seq}
    out = []
    for cfg in configs(args.concurrency, args.max_num_seqs, engine_spec):
        if cfg.key not in args.rows:
            continue
        over = [f"schedule.steps={args.steps}", f"seed={args.seed}", *cfg.overrides]
        if not args.learn:  # every row samples from the same (initial) policy: equal length distributions
            over.append("nodes.actor.config.train.lr=1e-30")
        print(f"  {engine:7s} {cfg.label:34s} ...", end=" ", flush=True)
        res = run_graph(graph, workdir / f"run-{engine}-{cfg.key}", overrides=over, timeout_s=args.timeout, cwd=ROOT)
        row = {"engine": engine, "row": cfg.key, "label": cfg.label, "overrides": cfg.overrides}
        if res.exit_code != 0:
            row["error"] = f"exit {res.exit_code}: {failure(res.stderr)}"
            print("failed", flush=True)
        else:
            try:
                row.update(measure(res, args.warmup))
                print(f"{row['completions_per_s']:.0f} completions/s", flush=True)
            except (ValueError, KeyError, OSError) as e:
                row["error"] = f"ran, but could not be measured: {e}"
                print("unmeasurable", flush=True)
        out.append(row)
    base = next((r for r in out if r["row"] == "a" and "error" not in r), None)
    for r in out:
        if base is not None and "error" not in r:
            r["speedup"] = r["completions_per_s"] / base["completions_per_s"]
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(rows: list[dict]) -> str:
    head = ("| engine | configuration | completions | completions/s | generated tokens/s | rollout busy | trainer wait "
            "| staleness held | reward (last 10) | speedup vs (a) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['label']} | failed | - | - | - | - | - | - | - |")
            continue
        wait = f"{pct(r['trainer_wait'])} ({r['trainer_wait_s_per_update']:.3f} s/update)"
        held = f"{pct(r['staleness_held'])} of {r['groups']}"
        lines.append(f"| {r['engine']} | {r['label']} | {r['completions']} | {r['completions_per_s']:.0f} "
                     f"| {r['generated_tokens_per_s']:.0f} "
                     f"| {pct(r['rollout_busy'])} | {wait} | {held} | {r['reward_last']:.3f} "
                     f"| {r.get('speedup', float('nan')):.2f}x |")
    return "\n".join(lines)


def parse_model(text: str) -> dict:
    """`d_model=256,n_layers=4` -> {"d_model": 256, "n_layers": 4} (empty: the graph's model)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        out[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["builtin", "vllm", "all"], default="builtin",
                   help="rollout engine(s) to measure; vLLM needs `pip install flowrl[vllm]` (its CPU build)")
    p.add_argument("--steps", type=int, default=60, help="updates per row (each 16 prompts x 8 samples)")
    p.add_argument("--warmup", type=int, default=5, help="updates left out of the measurement (start-up)")
    p.add_argument("--concurrency", type=int, default=32,
                   help="rollout concurrency N of rows (b)-(d); with group tickets, (k + 1) x 16 groups may be in flight")
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences the continuous engine decodes together")
    p.add_argument("--model", default="d_model=256,n_layers=4",
                   help="builtin engine: settings over the graph's tiny model for rollout and actor. The default "
                        "makes a decode step's cost grow with its rows, as an LLM's does; on the graph's own "
                        "64-wide model a step costs about the same for 8 rows or 128 (per-op overhead), so "
                        "static batches waste little and continuous batching gains less. '' keeps the graph's")
    p.add_argument("--learn", action="store_true",
                   help="train as the graph does; by default the actor's learning rate is ~0 so that every row "
                        "samples from the same policy: a policy that learns shorter or longer answers in one row "
                        "would change its completions/s by as much as the settings compared")
    p.add_argument("--rows", nargs="+", default=["a", "b", "c", "d"], choices=["a", "b", "c", "d"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a row's run is killed")
    p.add_argument("--quick", action="store_true", help="20 updates a row, 3 left out")
    p.add_argument("--keep", metavar="DIR", help="keep the run directories here (default: a temporary directory)")
    p.add_argument("--json", metavar="FILE", help="also write the rows here")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup = 20, 3
    engines = ["builtin", "vllm"] if args.engine == "all" else [args.engine]
    skipped = []
    if "vllm" in engines and importlib.util.find_spec("vllm") is None:
        engines.remove("vllm")
        skipped.append("vllm: not importable here (pip install flowrl[vllm] installs its CPU build); "
                       "its rows are skipped")
    print(f"long-tail GRPO ({GRAPH.relative_to(ROOT)}), {args.steps} updates a row ({args.warmup} left out), "
          f"max_staleness {MAX_STALENESS}, builtin model {args.model or 'of the graph'}")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="flowrl-async-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for engine in engines:
            rows += run_rows(engine, args, workdir)
    print()
    print(table(rows))
    for line in skipped:
        print(f"\n{line}")
    counts = {r["completions"] for r in rows if "completions" in r}
    if len(counts) > 1:
        print(f"\nnote: the rows trained on different numbers of completions ({sorted(counts)}): compare the rates, "
              "not the totals")
    failed = [r for r in rows if "error" in r]
    if failed:
        print("\nrows that did not run:")
        for r in failed:
            print(f"  {r['engine']} {r['label']}: {r['error']}")
    sources = sorted({r["busy_source"] for r in rows if "busy_source" in r})
    if sources:
        print(f"\nrollout busy from: {', '.join(sources)}; targets: (d) >= 2x (a) completions/s, rollout busy >= 80%, "
              "staleness held for 100% of groups")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
