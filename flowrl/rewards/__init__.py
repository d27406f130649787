"""Verifiable rewards as configuration: math answers, format, length shaping, sandboxed code.

    from flowrl.rewards import Inputs, parse_terms, score_terms
    per_term, scores = score_terms(parse_terms([{"type": "math"}]), Inputs(responses, references, lengths, 16))

The `rewards` node (nodes/rewards.py) decodes a batch's responses and applies a list of terms. The
pieces are plain functions of strings: math (extract_answer, is_equivalent), shaping
(format_scores, overlong_penalty), code (code_scores) over the sandbox (run_sandboxed, Limits).
math-verify is used when installed (pip install 'flowrl[rewards]').
"""

from flowrl.rewards.math import (
                                  extract_answer,
                                  is_equivalent,
                                  math_scores,
                                  reference_answer,
)
from flowrl.rewards.sandbox import Limits, SandboxResult, isolation_mode, run_sandboxed
from flowrl.rewards.shaping import format_scores, overlong_penalty
from flowrl.rewards.terms import (
                                  CodeTerm,
                                  FormatTerm,
                                  Inputs,
                                  LengthTerm,
                                  MathTerm,
    ReasoningGymTerm,
                                  TermSpec,
                                  parse_terms,
                                  score_terms,
                                  term_names,
)

__all__ = [
    "CodeTerm", "FormatTerm", "Inputs", "LengthTerm", "Limits", "MathTerm", "ReasoningGymTerm", "SandboxResult", "TermSpec",
    "extract_answer", "format_scores", "is_equivalent", "isolation_mode", "math_scores", "overlong_penalty",
    "parse_terms", "reference_answer", "run_sandboxed", "score_terms", "term_names",
]
