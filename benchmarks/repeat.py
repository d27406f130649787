"""Repeat one run many times, a few at a time, and count what must never happen: hangs, restarts
and re-issues in a fault-free run, and any ticket not consumed exactly once.

    python benchmarks/repeat.py graphs/ppo.yaml nodes.actor.devices=2 nodes.critic.devices=2 --runs 30 --jobs 2
    python benchmarks/repeat.py graphs/grpo.yaml --runs 4 --jobs 2 --limit-s 600

Each run is `flowrl run` with the default supervision settings in a child process group; a run
still going after `--limit-s` is a hang (its group is killed and its stack left in its run
directory's logs, after a `flowrl status --dump`). One line per run, then the totals; exit 0 only
when every run finished, exactly once, with no restart.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.testing.harness import flowrl_command, kill_group  # noqa: E402
from flowrl.runtime.protocol.ledger import audit_ledger, read_ledger  # noqa: E402

RESTARTS = ("node_down", "reissued", "recovery", "failed")


def one(i: int, graph: str, overrides: list[str], base: Path, limit_s: float) -> dict:
    run_dir = base / f"run{i:03d}"
    t0 = time.monotonic()
    proc = subprocess.Popen(flowrl_command(graph, run_dir, overrides=overrides), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    hung = False
    try:
        _, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        hung = True
        subprocess.run([sys.executable, "-m", "flowrl", "status", str(run_dir), "--dump"], capture_output=True,
                       timeout=60)
        time.sleep(2)  # the processes write their dumps
        kill_group(proc.pid)
        _, err = proc.communicate()
    wall = time.monotonic() - t0
    ledger = read_ledger(run_dir) if (run_dir / "ledger.jsonl").exists() else []
    audit = audit_ledger(ledger) if ledger else None
    consumed = {r["batch_id"] for r in ledger if r["event"] == "consumed"}
    return dict(run=i, exit=proc.returncode, hung=hung, wall_s=wall, tickets=len(consumed),
                restarts=sum(r["event"] in RESTARTS for r in ledger),
                exactly_once=bool(audit and audit.exactly_once), run_dir=str(run_dir),
                error="" if proc.returncode == 0 else (err or "").strip().splitlines()[-1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graph")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit-s", type=float, default=900.0, help="a run still going after this is a hang")
    ap.add_argument("--keep", default=None, help="folder for the run directories (default: a temporary one)")
    args = ap.parse_args(argv)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="flowrl-repeat-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"{args.runs} runs of flowrl run {args.graph} {' '.join(args.overrides)}, {args.jobs} at a time -> {base}")
    print(f"{'run':>4} {'exit':>5} {'hung':>5} {'wall s':>7} {'tickets':>8} {'restarts':>9} {'exactly once':>13}")
    rows = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(one, i, args.graph, args.overrides, base, args.limit_s) for i in range(args.runs)]
        for f in futures:
            r = f.result()
            rows.append(r)
            print(f"{r['run']:>4} {r['exit']:>5} {str(r['hung']):>5} {r['wall_s']:>7.1f} {r['tickets']:>8} "
                  f"{r['restarts']:>9} {str(r['exactly_once']):>13} {' '.join(r['error'])}", flush=True)
    ok = [r for r in rows if r["exit"] == 0 and not r["hung"] and r["restarts"] == 0 and r["exactly_once"]]
    walls = sorted(r["wall_s"] for r in rows)
    print(f"\nruns {len(rows)}: finished {sum(r['exit'] == 0 for r in rows)}, hung {sum(r['hung'] for r in rows)}, "
          f"with restarts {sum(r['restarts'] > 0 for r in rows)}, exactly once {sum(r['exactly_once'] for r in rows)}; "
          f"wall s median {walls[len(walls) // 2]:.0f}, max {walls[-1]:.0f}")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
