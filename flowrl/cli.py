"""The `flowrl` command: run | check | report | status | scale | export.

    flowrl check graphs/ppo.yaml
    flowrl run graphs/ppo.yaml schedule.steps=20

Kept thin: every subcommand imports its machinery only when it runs, so `flowrl --help` is instant
and `flowrl check` never imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_INTERNAL = 70
"""A flowrl bug (an exception flowrl did not expect), as EX_SOFTWARE in sysexits.h: never the 1 of
"the plan has errors / the run failed" nor the 2 of "the graph or inventory cannot be used"."""

EXIT_CODES = f"""exit codes:
  0   ok (check: no errors in the plan; run: reached its configured end)
  1   check: the plan has errors; run: the run failed
  2   the graph, an override or the inventory cannot be used (file:line: key: what and fix),
      or the command needs an optional extra that is not installed (it names the pip install)
  {EXIT_INTERNAL}  internal error: a flowrl bug; the traceback is saved to a file the message names
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flowrl",
        description="RL post-training of language models as a dataflow of OS processes.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("check", help="load a graph, plan its placement, print the plan and every finding",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("graph", help="graph file (YAML)")
    c.add_argument("overrides", nargs="*", metavar="key.path=value", help="override graph values")
    c.add_argument("--inventory", metavar="FILE", help="declared inventory (YAML) instead of this machine's devices, "
                   "or ray[:ADDRESS] for a Ray cluster's nodes")
    c.add_argument("--json", action="store_true", help="print the plan and findings as JSON")

    r = sub.add_parser("run", help="run a graph", epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    st.add_argument("--dump", action="store_true",
                    help="ask every node process of the run on this host to write what it waits on (its tasks' "
                         "stacks, its channels' counters, its input queues) into its log under RUN_DIR/logs")

    sc = sub.add_parser("scale", help="add or remove replicas of a stateless node while the run goes on")
    sc.add_argument("run_dir", metavar="RUN_DIR")
    sc.add_argument("changes", nargs="+", metavar="NODE=N", help="replicas wanted, e.g. rollout=3")

    ex = sub.add_parser("export", help="write a run's trained policy as a Hugging Face model folder")
    ex.add_argument("run_dir", metavar="RUN_DIR")
    what = ex.add_mutually_exclusive_group(required=True)
    what.add_argument("--hf", metavar="OUT", help="output folder (config.json, model.safetensors, tokenizer); "
                      "a LoRA actor's base with its adapters merged")
    what.add_argument("--adapter", metavar="OUT", help="a LoRA actor's adapters as a peft folder "
                      "(adapter_config.json, adapter_model.safetensors)")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the last committed one)")
    ex.add_argument("--node", default="actor", help="node whose policy to export (default: actor)")
    return p


def internal_error(command: str, exc: BaseException, run_dir: str | None = None) -> int:
    """Say that flowrl has a bug, save the traceback (in `run_dir` if it exists, else the system
    temp dir) and return EXIT_INTERNAL."""
    import tempfile
    import time
    import traceback
    from pathlib import Path

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    folder = Path(run_dir) if run_dir and Path(run_dir).is_dir() else Path(tempfile.gettempdir())
    name = f"flowrl-{command}-internal-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    where = folder / name
    try:
        where.write_text(f"flowrl {' '.join(sys.argv[1:])}\n\n{text}")
        saved = f"the traceback is saved in {where}"
    except OSError as e:
        saved = f"the traceback could not be saved ({e.strerror}); it follows:\n{text}"
    why = str(exc).splitlines()[0][:300] if str(exc) else ""
    print(f"flowrl {command}: internal error: {type(exc).__name__}{': ' + why if why else ''}\n"
          f"This is a bug in flowrl, not a problem with your graph or inventory; {saved}. Please report it "
          f"with that file (exit code {EXIT_INTERNAL}).", file=sys.stderr)
    return EXIT_INTERNAL


EXIT_EXTRA = 2
"""A command needs an optional extra that is not installed: like unusable input, the fix is the user's."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except Exception as e:  # noqa: BLE001 - an optional package missing, else a flowrl bug
        if isinstance(e, ImportError) and _extra_missing(args.command, e):
            return EXIT_EXTRA
        if args.command not in ("check", "run"):
            raise
        return internal_error(args.command, e, getattr(args, "run_dir", None) or getattr(args, "resume", None))


def _extra_missing(command: str | None, exc: ImportError) -> bool:
    """Name the extra and its install command for an ImportError of an optional package; False
    for any other ImportError (a bug)."""
    from flowrl.placement.extras import extra_for, install

    found = extra_for(exc)
    if found is None:
        return False
    module, extra = found
    why = f" ({module} is not installed)" if module else f" ({str(exc).splitlines()[0][:200]})"
    print(f"flowrl {command} needs the '{extra}' extra{why}: {install(extra)}", file=sys.stderr)
    return True


def _run_preflight(args) -> int | None:
    """Before `flowrl run` starts anything: every extra the graph uses is installed (the node
    processes would fail on the import otherwise). None when fine or when the graph cannot be
    loaded here (run_main reports that)."""
    from flowrl.graph import load_graph
    from flowrl.graph.errors import GraphError
    from flowrl.placement.extras import missing

    try:
        spec = load_graph(args.graph, list(args.overrides or []))
    except GraphError:
        return None
    lost = missing(spec)
    for need in lost:
        print(need.text("flowrl run"), file=sys.stderr)
    return EXIT_EXTRA if lost else None


def _dispatch(args) -> int:
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
        if args.graph and not args.resume and (code := _run_preflight(args)) is not None:
            return code
        from flowrl.runtime.controller.run import run_main

        return run_main(args)
    if args.command == "report":
        from flowrl.metrics import report

        return report.main(args.run_dir)
    if args.command == "status":
        if args.dump:
            from flowrl.runtime.launch.dump import dump_processes

            return dump_processes(args.run_dir)
        from flowrl.metrics import show_status

        return show_status(args.run_dir, follow=args.follow)
    if args.command == "scale":
        return _scale(args)
    if args.command == "export":
        from flowrl.export import CheckpointError, export_adapter, export_hf

        try:
            write, target = (export_hf, args.hf) if args.hf else (export_adapter, args.adapter)
            out = write(args.run_dir, target, node=args.node, step=args.step)
        except (CheckpointError, ValueError) as e:
            print(f"flowrl export: {e}", file=sys.stderr)
            return 1
        print(f"flowrl export: {args.node} of {args.run_dir} -> {out}", flush=True)
        return 0
    return 2


def _scale(args) -> int:
    from flowrl.runtime.controller.scaling import ScaleError, request

    for change in args.changes:
        node, sep, n = change.partition("=")
        if not sep or not n.isdigit():
            print(f"flowrl scale: {change!r} is not NODE=N (e.g. rollout=3)", file=sys.stderr)
            return 2
        try:
            print(request(args.run_dir, node, int(n)), flush=True)
        except ScaleError as e:
            print(f"flowrl scale: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
