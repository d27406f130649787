"""Code answers: run the response's program on each test case in the sandbox, compare the output.

    >>> tests = '[{"input": "2 3\\\\n", "output": "5\\\\n"}]'
    >>> code_scores(["```python\\nprint(sum(map(int, input().split())))\\n```"], [tests])
    [1.0]

The reference answer holds the tests as JSON: a list of ``{"input": ..., "output": ...}`` or the
APPS / TACO form ``{"inputs": [...], "outputs": [...]}``. The program is the last fenced code
block of the response (or the whole response when it has none). Outputs are compared line by line
with trailing whitespace ignored. Score: the fraction of tests passed (``all_or_nothing``: 1 only
when every test passes). Samples run in parallel threads, each test in its own sandbox.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

from flowrl.rewards.sandbox import Limits, run_sandboxed

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(reference: str) -> list[tuple[str, str]]:
    try:
        data = json.loads(reference)
    except json.JSONDecodeError:
        raise ValueError(f"code tests must be JSON ([{{'input', 'output'}}] or {{'inputs', 'outputs'}}), "
                         f"got {reference[:80]!r}") from None
    if isinstance(data, dict) and "inputs" in data:
        return [(str(i), str(o)) for i, o in zip(data["inputs"], data["outputs"])]
    if isinstance(data, list):
        return [(str(t["input"]), str(t["output"])) for t in data]
    raise ValueError(f"code tests must be a list of {{input, output}} or {{inputs, outputs}}, got {type(data).__name__}")


def same_output(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]
    return norm(got) == norm(want)


def score_program(code: str, tests: list[tuple[str, str]], limits: Limits, all_or_nothing: bool = False,
                  require_isolation: bool = False) -> float:
    passed = 0
    for stdin, want in tests:
        r = run_sandboxed(code, stdin, limits=limits, require_isolation=require_isolation)
        if r.status == "ok" and same_output(r.stdout, want):
            passed += 1
        elif all_or_nothing:
            return 0.0
    if not tests:
        return 0.0
    return float(passed == len(tests)) if all_or_nothing else passed / len(tests)


def code_scores(responses: list[str], references: list[str], limits: Limits = Limits(), *,
                all_or_nothing: bool = False, workers: int = 2, require_isolation: bool = False) -> list[float]:
    tests = [parse_tests(r) for r in references]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda a: score_program(extract_code(a[0]), a[1], limits, all_or_nothing,
                                                     require_isolation), zip(responses, tests)))
