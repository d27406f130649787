"""Fuzz graph and inventory files through `flowrl check`'s own code path.

    python benchmarks/fuzz_graphs.py                  # 10,000 seeded mutations (a few minutes)
    python benchmarks/fuzz_graphs.py -n 300 --seed 1  # the slice the test suite runs
    python benchmarks/fuzz_graphs.py --save fuzz-failures/  # keep every file that broke a rule

Every shipped graph (graphs/, examples/) with its inventory (from its `# Check:` line) and every
shipped inventory is mutated the ways careless users and attackers do it: byte flips, truncation,
other encodings, alias bombs, deep nesting, long lists, odd keys and values, huge numbers and
strings, merge keys, moved and dropped lines. Each mutant goes through `check_graph` (load, inventory, plan) and
the table renderer, in this process, under a per-file time limit. The rules, all must print 0:

    tracebacks        an exception other than GraphError (a flowrl bug)
    over 5 s          a file that took longer than the limit
    unlocated         a problem without file:line or a key path
    over 2,000 chars  a problem or finding message longer than 2,000 characters
"""

from __future__ import annotations

import argparse
import io
import random
import re
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LIMIT_S = 5.0
BOMB = ('lol0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
        + "".join(f"lol{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9)))
ODD_KEYS = ["0x10", "1:20", "? [a, b]\n: 1", "~", ".inf", "2001-01-01", "true", "[a]", "{a: 1}", "!!int abc",
            "'é'", "-1", "1e400", "<<", "'\u202e'", "!!binary aGk=", "&x k", "*undefined"]
ODD_VALUES = ["!!int abc", ".inf", "-.inf", ".nan", '"..:X"', '":"', "1.0e400", "9" * 5000, "-1", "0", "1000000000",
              "null", "[]", "{}", "!!binary xx", "!!python/object:os.system x", "*undefined", "!!timestamp x",
              "!!float x", "!!bool maybe", "'\x07'", "[1, [2, [3]]]", "2001-01-01", "0o17", "0b101", "1_000",
              "!!set {a, b}", "!!omap [a: 1]", "1:20:30", "0x7fffffffffffffffffff", "[0, 0, 0]", "auto", "'host:1'",
              "[100000, 100000]", "99999999999999999999999"]
ENCODINGS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig", "latin-1", "cp1252", "utf-32-be"]


def seeds() -> list[tuple[Path, Path | None, str]]:
    """(graph, inventory, which file to mutate) for every shipped file."""
    out = []
    for graph in sorted([*ROOT.glob("graphs/*.yaml"), *ROOT.glob("examples/**/*.yaml")]):
        if "inventories" in graph.parts:
            continue
        m = re.search(r"--inventory (\S+)", graph.read_text())
        inv = ROOT / m.group(1) if m else None
        out.append((graph, inv, "graph"))
        if inv is not None:
            out.append((graph, inv, "inventory"))
    users = {inv for _, inv, _ in out if inv}
    for inv in sorted(ROOT.glob("examples/inventories/*.yaml")):
        if inv not in users:
            out.append((ROOT / "graphs" / "ppo.yaml", inv, "inventory"))
    return out


def _value_lines(text: str) -> list[int]:
    return [i for i, line in enumerate(text.splitlines()) if re.search(r":\s+\S", line) and not line.lstrip().startswith("#")]


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One mutation of `data`: (its name, the new bytes)."""
    if not data:
        data = b"\n"
    text = data.decode("utf-8")
    lines = text.splitlines() or [""]
    kind = rng.choice(["flip", "flip", "truncate", "encoding", "bomb", "deep", "key", "value", "value", "huge-number",
                       "huge-string", "merge", "lines", "empty", "indent", "kind", "long", "combo"])
    if kind == "flip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)  # len(b) >= 1: empty data became a newline
        return kind, bytes(b)
    if kind == "truncate":
        return kind, data[: rng.randrange(len(data))]
    if kind == "encoding":
        enc = rng.choice(ENCODINGS)
        if enc in ("latin-1", "cp1252"):
            text = text.replace("name: ", "name: café-", 1)
        return f"{kind}:{enc}", text.encode(enc, "replace")
    idx = _value_lines(text) or [0]
    i = rng.choice(idx)
    line = lines[i] if lines else ""
    indent = line[: len(line) - len(line.lstrip())]
    key = line.split(":", 1)[0] if ":" in line else "x"
    if kind == "bomb":
        depth = rng.randint(3, 9)
        lines[i] = f"{key}: *a{depth - 1}"
        return kind, (BOMB + "\n".join(lines)).encode()
    if kind == "deep":
        n = rng.choice([40, 70, 200, 1500, 5000])
        value = "[" * n + "]" * n if rng.random() < 0.5 else "{a: " * n + "1" + "}" * n
        lines[i] = f"{key}: {value}"
    elif kind == "key":
        lines.insert(i, indent + rng.choice(ODD_KEYS) + ": 1")
    elif kind in ("value", "kind"):
        if kind == "kind":
            ks = [j for j, x in enumerate(lines) if "kind:" in x] or [i]
            i = rng.choice(ks)
            key = lines[i].split(":", 1)[0]
            value = rng.choice(['"..:X"', '":"', '"a:"', '":b"', '"os:path"', '"flowrl:Node"', '"x" ', '"a..b:C"',
                                '"tests.placement.roles:Nope"', '"1abc:X"', '"\u00e9:X"', "[a]", "{}", "null"])
        else:
            value = rng.choice(ODD_VALUES)
        lines[i] = f"{key}: {value}"
    elif kind == "huge-number":
        name = rng.choice(["replicas", "devices", "mesh", "steps", "memory_gb", "cpus", "id", "capacity", "batch_size"])
        value = rng.choice(["1000000000", "100000", "[100000, 100000]", "10" * 30, "1e308", "4096"])
        lines[i] = f"{indent}{name}: {value}" if rng.random() < 0.7 else f"{key}: {value}"
    elif kind == "huge-string":
        n = rng.choice([300, 5000, 1 << 20])
        lines[i] = f"{key}: {'x' * n}" if rng.random() < 0.5 else f"{indent}{'k' * n}: 1"
    elif kind == "long":
        n = rng.choice([1000, 30_000, 300_000])
        lines[i] = f"{key}: [{', '.join(['1'] * n)}]" if rng.random() < 0.5 else f"{key}:\n" + f"{indent}  - 1\n" * n
    elif kind == "merge":
        lines.insert(0, "base: &base {replicas: 2, devices: 1, dtype: bfloat16, colocate_with: [actor]}")
        nodes = [j for j, x in enumerate(lines) if re.match(r"^  [A-Za-z_]\w*:\s*$", x)]
        if nodes:
            j = rng.choice(nodes)
            lines.insert(j + 1, "    <<: *base")
        else:
            lines.insert(i + 1, indent + "<<: *base")
    elif kind == "lines":
        if len(lines) > 2:
            a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
            op = rng.choice(["swap", "dup", "drop"])
            if op == "swap":
                lines[a], lines[b] = lines[b], lines[a]
            elif op == "dup":
                lines.insert(a, lines[b])
            else:
                del lines[a]
    elif kind == "empty":
        return kind, rng.choice([b"", b"---\n", b"---", b"\xef\xbb\xbf", b"   \n\n", b"# only a comment\n", b"...\n",
                                 b"--- |\n  text\n", b"- a\n- b\n", b"42\n", b"!!int abc\n", b"~\n", b"---\n---\n"])
    elif kind == "indent":
        lines[i] = (" " if rng.random() < 0.5 else "\t") + line
    elif kind == "combo":
        out = data
        for _ in range(rng.randint(2, 4)):
            _, out = mutate(out, rng) if _decodes(out) else ("", out)
        return kind, out
    return kind, ("\n".join(lines) + "\n").encode()


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_one(graph: Path, inventory: Path | None, render: bool) -> tuple[str, list[str]]:
    """Check one graph as `flowrl check` does. Returns (outcome, messages to audit)."""
    from rich.console import Console

    from flowrl.graph.errors import GraphError
    from flowrl.placement.check import check_graph
    from flowrl.placement.check import render as render_plan

    try:
        plan = check_graph(str(graph), (), str(inventory) if inventory else None)
    except GraphError as e:
        return "rejected", [("problem", p) for p in e.problems] + [("text", str(e))]
    if render:
        render_plan(plan, str(graph), Console(file=io.StringIO(), width=140))
    return ("errors" if plan.errors else "ok"), [("finding", f) for f in plan.findings]


def audit(messages) -> tuple[int, int, str]:
    """(unlocated, too long, an example) over the messages of one run."""
    unlocated = too_long = 0
    example = ""
    for kind, m in messages:
        if kind == "problem":
            if not (m.file and (m.line is not None or m.path)):
                unlocated += 1
                example = example or str(m)
            if len(str(m)) > 2000:
                too_long += 1
                example = example or str(m)[:300]
        elif kind == "finding" and len(m.message) > 2000:
            too_long += 1
            example = example or m.message[:300]
        elif kind == "text" and len(m) > 30_000:
            too_long += 1
    return unlocated, too_long, example


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=10_000, help="mutations (default 10,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", metavar="DIR", help="save each file that broke a rule here")
    ap.add_argument("--limit", type=float, default=LIMIT_S, help="per-file time limit in seconds")
    args = ap.parse_args(argv)
    stats = fuzz(args.n, args.seed, args.limit, args.save, verbose=True)
    rows = [("files", stats["files"]), ("rejected (exit 2)", stats["rejected"]), ("planned with errors (exit 1)", stats["errors"]),
            ("planned ok (exit 0)", stats["ok"]), ("tracebacks", stats["tracebacks"]), (f"runs over {args.limit:g} s", stats["slow"]),
            ("messages without file:line or key path", stats["unlocated"]), ("messages over 2,000 characters", stats["too_long"]),
            ("slowest run (s)", f"{stats['max_s']:.2f}"), ("total (s)", f"{stats['total_s']:.1f}")]
    width = max(len(r[0]) for r in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value:>8}")
    bad = stats["tracebacks"] + stats["slow"] + stats["unlocated"] + stats["too_long"]
    return 1 if bad else 0


def fuzz(n: int, seed: int, limit: float = LIMIT_S, save: str | None = None, verbose: bool = False) -> dict:
    """Run `n` seeded mutations; returns the counts the table prints (and `failures`, examples)."""
    import tempfile

    rng = random.Random(seed)
    pool = seeds()
    stats = dict(files=0, rejected=0, errors=0, ok=0, tracebacks=0, slow=0, unlocated=0, too_long=0,
                 max_s=0.0, total_s=0.0, failures=[])
    old = signal.signal(signal.SIGALRM, _alarm)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="flowrl-fuzz-") as tmp:
            for i in range(n):
                graph, inv, which = rng.choice(pool)
                target = graph if which == "graph" else inv
                name, data = mutate(target.read_bytes(), rng)
                path = Path(tmp) / f"m{i % 50}-{target.name}"
                path.write_bytes(data)
                g, v = (path, inv) if which == "graph" else (graph, path)
                t0 = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, limit)
                failure = ""
                try:
                    outcome, messages = run_one(g, v, render=i % 4 == 0)
                    stats[outcome] += 1
                    unlocated, too_long, example = audit(messages)
                    stats["unlocated"] += unlocated
                    stats["too_long"] += too_long
                    if unlocated or too_long:
                        failure = f"message: {example}"
                except _Timeout:
                    stats["slow"] += 1
                    failure = f"over {limit} s"
                except Exception:  # noqa: BLE001 - counting flowrl bugs is the point
                    stats["tracebacks"] += 1
                    failure = traceback.format_exc(limit=-4)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                dt = time.perf_counter() - t0
                stats["max_s"] = max(stats["max_s"], dt)
                stats["files"] += 1
                if failure:
                    stats["failures"].append((i, name, target.name, failure))
                    if verbose:
                        print(f"#{i} {name} of {target.name}: {failure.strip().splitlines()[-1][:300]}", flush=True)
                    if save:
                        Path(save).mkdir(parents=True, exist_ok=True)
                        (Path(save) / f"{i}-{name.replace(':', '-')}-{target.name}").write_bytes(data)
                if verbose and (i + 1) % 1000 == 0:
                    print(f"{i + 1} files, {time.perf_counter() - start:.0f} s", flush=True)
    finally:
        signal.signal(signal.SIGALRM, old)
    stats["total_s"] = time.perf_counter() - start
    return stats


if __name__ == "__main__":
    sys.exit(main())
