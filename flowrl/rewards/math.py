"""Math answers: pull the final answer out of a response and check it against the reference.

    >>> extract_answer("so the total is \\\\boxed{\\\\frac{3}{4}}")
    '\\\\frac{3}{4}'
    >>> extract_answer("She has 5 + 7 = 12 apples.\\n#### 12")
    '12'
    >>> is_equivalent("0.75", "\\\\frac{3}{4}"), is_equivalent("12", "13")
    (True, False)

Extraction, in order: the last ``\\boxed{...}`` (braces balanced), the text after the last
``####`` (GSM8K style), else the last number in the text. Equivalence: equal numbers (exact, via
fractions: "1,000" = "1000" = "1000.0", "3/4" = "0.75") decide at once; otherwise `math-verify`
when installed (pip install 'flowrl[rewards]'; LaTeX, sets, intervals), else sympy on short plain
expressions, else the normalised strings.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*(.+)")


def _boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i: j - 1].strip() if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None when it states none."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def reference_answer(text: str) -> str:
    """The answer of a dataset's reference: after `####` or inside `\\boxed{}` when present, else all of it."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    hashes = _HASHES.findall(text)
    return hashes[-1].strip() if hashes else text.strip()


def as_number(text: str) -> Fraction | None:
    """``"1,234.5"``, ``"-3/4"``, ``"$12"``, ``"50%"`` -> exact Fraction; None if not a plain number."""
    s = text.strip().strip("$").strip().rstrip(".").replace(",", "").replace(" ", "")
    s = s.removeprefix("\\$")
    percent = s.endswith("%") or s.endswith("\\%")
    s = s.rstrip("%").removesuffix("\\")
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def _math_verify():
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def is_equivalent(answer: str | None, reference: str) -> bool:
    """Whether an extracted answer equals the reference answer (see the module docstring)."""
    if answer is None:
        return False
    a, r = as_number(answer), as_number(reference)
    if a is not None and r is not None:
        return a == r
    mv = _math_verify()
    if mv is not None:
        # math-verify's timeouts use SIGALRM, which only the main thread may set
        main = threading.current_thread() is threading.main_thread()
        t = 5 if main else None
        try:
            gold = mv.parse(_dollars(reference), parsing_timeout=t)
            pred = mv.parse(_dollars(answer), parsing_timeout=t)
            return bool(gold and pred and mv.verify(gold, pred, timeout_seconds=t))
        except Exception:
            return False
    return _sympy_equal(answer, reference)


def _dollars(s: str) -> str:
    return s if "$" in s or "\\boxed" in s else f"${s}$"


def _norm(s: str) -> str:
    return re.sub(r"\s+", "", s).strip("$.").lower()


def _sympy_equal(answer: str, reference: str) -> bool:
    if _norm(answer) == _norm(reference):
        return True
    if max(len(answer), len(reference)) > 60 or not re.fullmatch(r"[\w\s+\-*/^().]+", answer + reference):
        return False
    try:
        import sympy
        from sympy.parsing.sympy_parser import parse_expr

        diff = parse_expr(answer.replace("^", "**")) - parse_expr(reference.replace("^", "**"))
        return bool(sympy.simplify(diff) == 0)
    except Exception:
        return False


def math_scores(responses: list[str], references: list[str]) -> list[float]:
    """1.0 where the response's extracted answer equals the reference's, else 0.0."""
    return [float(is_equivalent(extract_answer(r), reference_answer(ref))) for r, ref in zip(responses, references)]
