"""The `flowrl` command: run | check | report | status.

    flowrl check graphs/ppo.yaml
    flowrl run graphs/ppo.yaml schedule.steps=20

Kept thin: every subcommand imports its machinery only when it runs, so `flowrl --help` is instant
and `flowrl check` never imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flowrl",
        description="RL post-training of language models as a dataflow of OS processes.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("check", help="load a graph, plan its placement, print the plan and every finding")
    c.add_argument("graph", help="graph file (YAML)")
    c.add_argument("overrides", nargs="*", metavar="key.path=value", help="override graph values")
    c.add_argument("--inventory", metavar="FILE", help="declared inventory (YAML) instead of this machine's devices, "
                   "or ray[:ADDRESS] for a Ray cluster's nodes")
    c.add_argument("--json", action="store_true", help="print the plan and findings as JSON")

    r = sub.add_parser("run", help="run a graph")
    r.add_argument("graph", nargs="?", help="graph file (YAML); not needed with --resume")
    r.add_argument("overrides", nargs="*", metavar="key.path=value", help="override graph values")
    r.add_argument("--run-dir", metavar="DIR", help="run directory (default: runs/<name>-<timestamp>)")
    r.add_argument("--steps", type=int, help="training steps (overrides schedule.steps)")
    r.add_argument("--dry-run", action="store_true", help="load, check and plan, print, and exit")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    r.add_argument("--fault", action="append", default=[], metavar="SPEC", help="inject a fault (repeatable)")
    r.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on 127.0.0.1:PORT")
    r.add_argument("--inventory", metavar="FILE", help="declared inventory (YAML), or ray[:ADDRESS]")
    r.add_argument("--quiet", action="store_true", help="no live view; plain log lines only")

    rep = sub.add_parser("report", help="plots and a text summary of a finished run")
    rep.add_argument("run_dir", metavar="RUN_DIR")

    st = sub.add_parser("status", help="print the live state of a running job")
    st.add_argument("run_dir", metavar="RUN_DIR")
    st.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `kind: mypkg.module:Class` resolves from here, as with `python -m`
    if args.command is None:
        _parser().print_help()
        return 2
    if args.command == "check":
        from flowrl.placement.check import check_main

        return check_main(args)
    if args.command == "run":
        if not args.graph and not args.resume:
            _parser().parse_args(["run", "--help"])
        if args.graph and "=" in args.graph and not args.resume:
            print(f"flowrl run: {args.graph!r} looks like an override; give the graph file first", file=sys.stderr)
            return 2
        if args.resume and args.graph and "=" in args.graph:
            args.overrides, args.graph = [args.graph, *args.overrides], None
        from flowrl.runtime.run import run_main

        return run_main(args)
    if args.command == "report":
        from flowrl.metrics import report

        return report.main(args.run_dir)
    if args.command == "status":
        from flowrl.metrics import show_status

        return show_status(args.run_dir, follow=args.follow)
    return 2


if __name__ == "__main__":
    sys.exit(main())
