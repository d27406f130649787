"""Token exactness, checked against the engine's own record: every model turn an agent trained on
is exactly what a rollout replica generated, for exactly the conversation it was given.

    report = check_run(run_dir)          # rollout: {record_requests: true}, agent: {record_trajectories: true}
    assert report.ok, report.problems[:3]
    report.turns                         # model turns checked

Two records, written by different processes:

- `RUN_DIR/served/<rollout>.<replica>.jsonl` -- the rollout's (`record_requests: true`): for every
  service request, its session, the prompt token ids it was given and the token ids it generated;
- `RUN_DIR/trajectories/<agent>.<replica>.jsonl` -- the agent's (`record_trajectories: true`): for
  every episode it emitted, its session, token ids and loss mask, as they left on the data edge
  (the trainer gets these very tensors).

For every trajectory, each run of loss-masked tokens (a model turn) starting at position `o` must
be the tokens of a request of the same session whose prompt is the trajectory's first `o` tokens.
That catches both ways a conversation gets re-tokenized: the trained tokens of a turn differ from
what the engine generated (a client that kept the turn's text and encoded it again), or the engine
was given a different prefix than the one trained on (a client that rendered the whole conversation
again from its text before a later turn). Tokens off the mask (the prompt, the environment's and
the tools' messages) are what the chat format made once; they are checked as the prefixes of later
requests. A trajectory whose mask covers a token no request produced fails too.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable


@dataclass
class ExactReport:
    trajectories: int = 0
    turns: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.trajectories > 0


def read_lines(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def model_turns(mask: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of every run of True in `mask`."""
    turns, start = [], None
    for j, m in enumerate([*mask, False]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            turns.append((start, j))
            start = None
    return turns


def check(trajectories: Iterable[dict], served: Iterable[dict]) -> ExactReport:
    """Each trajectory `{session, tokens, mask}` against the served requests `{session, prompt, tokens}`."""
    by_session: dict[str, dict[tuple, list[int]]] = defaultdict(dict)
    for s in served:
        by_session[s["session"]][tuple(s["prompt"])] = list(s["tokens"])  # a retried request: the same prompt
    report = ExactReport()
    for t in trajectories:
        report.trajectories += 1
        tokens, mask, session = list(t["tokens"]), [bool(m) for m in t["mask"]], t["session"]
        if len(tokens) != len(mask):
            report.problems.append(f"session {session}: {len(tokens)} tokens but {len(mask)} mask entries")
            continue
        asked = by_session.get(session, {})
        k = 0
        for start, end in model_turns(mask):
            a = start
            while a < end:  # a run of model tokens: one turn, or turns with nothing between them
                report.turns += 1
                problem, a = _turn(session, k, tokens, a, end, asked)
                k += 1
                if problem:
                    report.problems.append(problem)
                    break
    return report


def check_run(run_dir: str | Path) -> ExactReport:
    """`check` over a run's records (see the module docstring for what writes them)."""
    run_dir = Path(run_dir)
    if not (run_dir / "served").is_dir() or not (run_dir / "trajectories").is_dir():
        raise FileNotFoundError(f"{run_dir} has no served/ or trajectories/ records: run with "
                                "nodes.rollout.config.record_requests=true and nodes.agent.config.record_trajectories=true")
    return check(read_lines(run_dir / "trajectories"), read_lines(run_dir / "served"))


def _turn(session, k: int, tokens: list[int], a: int, end: int, asked: dict) -> tuple[str | None, int]:
    """Model turn `k` starting at `a` (its run of masked tokens ends at `end`): a problem, and where it ended."""
    made = asked.get(tuple(tokens[:a]))
    if made is None:
        close = max(asked, key=lambda p: _common(p, tokens[:a]), default=())
        at = _common(close, tokens[:a])
        return (f"session {session}, model turn {k} (from token {a}): no request of this session had the "
                f"trajectory's first {a} tokens as its prompt (the closest differs at token {at}: "
                f"{list(close[at:at + 4])} sent vs {tokens[at:at + 4]} trained): the conversation was "
                "re-tokenized between the engine and the trainer"), end
    if not made or tokens[a:a + len(made)] != made:
        at = _common(made, tokens[a:end])
        return (f"session {session}, model turn {k} (from token {a}): trained {tokens[a + at:a + at + 4]} at its "
                f"token {at}, the engine generated {made[at:at + 4]}: a turn must be trained on as generated"), end
    if a + len(made) > end:
        return (f"session {session}, model turn {k}: the engine generated {len(made)} tokens, the mask covers "
                f"{end - a}: the loss mask must cover exactly the model's tokens"), end
    return None, a + len(made)


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
