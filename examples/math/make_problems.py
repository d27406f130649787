"""Write the arithmetic word problems that graphs/grpo-math.yaml trains and evaluates on.

    python examples/math/make_problems.py            # -> examples/math/train.jsonl, test.jsonl

One line per problem, `{"question": "...", "answer": "7"}`: one-step additions and subtractions
of single digits with single-digit answers ("Ann has 3 cups and gets 4 more. How many cups?"),
short enough for the built-in character-level model, and worded alike (names of three letters,
things of four), so the numbers stand at the same places: that is what lets a model trained from
scratch by RL alone learn the arithmetic on a CPU within minutes. Seeded: the files are the same on
every machine. The test set holds problems that are not in the training set.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Ann", "Bob", "Sam", "Eve", "Tom", "Mia")
ITEMS = ("pens", "cats", "cups", "eggs", "hats", "owls", "keys")
ADD = ("{n} has {a} {i} and gets {b} more. How many {i}?",)
SUB = ("{n} has {a} {i} and gives away {b}. How many {i}?",)


def all_problems() -> list[dict]:
    out = []
    for n in NAMES:
        for i in ITEMS:
            for a in range(10):
                for b in range(10):
                    if a + b <= 9:
                        out += [{"question": t.format(n=n, i=i, a=a, b=b), "answer": str(a + b)} for t in ADD]
                    if b <= a:
                        out += [{"question": t.format(n=n, i=i, a=a, b=b), "answer": str(a - b)} for t in SUB]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent))
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    problems = all_problems()
    random.Random(args.seed).shuffle(problems)
    if args.train + args.test > len(problems):
        raise SystemExit(f"only {len(problems)} distinct problems; ask for fewer than --train + --test")
    out = Path(args.out)
    for name, rows in (("train", problems[: args.train]), ("test", problems[args.train: args.train + args.test])):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {len(rows)} problems to {out / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
