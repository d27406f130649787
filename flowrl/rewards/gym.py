"""reasoning-gym items scored by reasoning-gym's own checker (pip install reasoning-gym).

    >>> entry = {"question": "Calculate 5 - 3.", "answer": "2", "metadata": {"source_dataset": "basic_arithmetic", ...}}
    >>> reasoning_gym_scores(["<answer>2</answer>"], [json.dumps(entry)])     # doctest: +SKIP
    [1.0]

The reference is the whole item as JSON (what the dataset node writes for `answer_field: entry`);
its `metadata.source_dataset` names the checker. Scores are the checker's, in [0, 1].
"""

from __future__ import annotations

import json
import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_tagged(response: str) -> str:
    found = _ANSWER.findall(response)
    return (found[-1] if found else response).strip()


def reasoning_gym_scores(responses: list[str], references: list[str]) -> list[float]:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("the reasoning_gym reward term needs the reasoning-gym package: pip install reasoning-gym") from None
    out = []
    for response, ref in zip(responses, references):
        try:
            entry = json.loads(ref)
            name = entry["metadata"]["source_dataset"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError("the reasoning_gym term needs whole reasoning-gym items as references: read the data "
                             "with `format: reasoning_gym` and `answer_field: entry`") from None
        score = reasoning_gym.get_score_answer_fn(name)(answer=extract_tagged(response), entry=entry)
        out.append(float(score or 0.0))
    return out
