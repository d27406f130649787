"""TextArena single-player games as flowrl agent environments.

    env = TextArenaEnv("GuessTheNumber-v0")
    env.reset({"index": 3, "sample": 0, "seed": 7, "ticket": 0})
    # -> [{"role": "user", "content": "You are Player 0. You are playing Guess The Number. ..."}]
    env.step("My guess: [10]")   # -> Step([{"role": "user", "content": "The target number is lower."}], 0.0, False)
    env.step("[8]")              # -> Step([], reward=1.0, done=True, info={"reason": "Congratulations! ..."})

In a graph: ``kind: agent, config: {env: "flowrl.agents.adapters.textarena:TextArenaEnv", env_config:
{env_id: "GuessTheNumber-v0"}}``.

The mapping. TextArena's loop is ``env.reset(num_players=1, seed=s)``, then ``env.get_observation()
-> (player_id, [(from_id, message, ObservationType), ...])`` (the messages since the player last
looked), ``env.step(action) -> (done, info)``, and at the end ``env.close() -> (rewards,
game_info)`` with ``rewards = {0: r}``. The game is built *without* TextArena's observation wrappers
(they re-send the whole history as one string each turn, for stateless agents); the adapter sends
each turn's new game messages as one user message instead, leaving out the echo of the model's own
move, so the chat grows turn by turn and no token is re-sent. The reward arrives on the last step
(TextArena scores only at the end: 1 for a win, partial credit or -1 for a loss, per game).

Seeding: the game is seeded with ``seed + task["index"]``, so the n samples of one task play the
same game (a GRPO group compares like with like) and a replayed ticket replays it; pass
``seed_by="episode"`` to seed with ``task["seed"]`` instead. TextArena games draw from Python's
global ``random``; the adapter keeps a private generator state per episode (swapped in under a lock
around each call), so concurrent episodes in one process do not disturb each other's draws.
"""

from __future__ import annotations

import importlib
import random
import threading
from collections.abc import Mapping
from typing import Any

from flowrl.agents.adapters import import_library, some
from flowrl.agents.base import Step

_RANDOM_LOCK = threading.Lock()
"""TextArena games use the process-wide ``random``: one episode's call at a time holds it."""

_EXAMPLES = ("GuessTheNumber-v0", "TowerOfHanoi-v0", "Mastermind-v0", "FrozenLake-v0", "Countdown-v0")


class TextArenaEnv:
    """One TextArena single-player game at a time.

    ``env_id``: a registered id (``GuessTheNumber-v0``, ``TowerOfHanoi-v0``, ``Mastermind-v0``, ...; a
    ``-train``/``-raw`` variant plays the same game: the adapter drops the variant's wrappers).
    ``env_kwargs`` override the registered game parameters (``{"max_turns": 5}``). ``seed``: the base of
    the game seed; ``seed_by``: ``index`` (the task's index, the default) or ``episode`` (``task["seed"]``).
    ``system_prompt``: an optional system message before the game's prompt. ``format_actions``: wrap a
    move that has no ``[...]`` in brackets, as TextArena's ``ActionFormattingWrapper`` does.
    """

    def __init__(self, env_id: str, env_kwargs: Mapping[str, Any] | None = None, seed: int = 0,
                 seed_by: str = "index", system_prompt: str | None = None, format_actions: bool = False):
        import_library("textarena", "textarena", "TextArenaEnv")
        registry = importlib.import_module("textarena.envs.registration").ENV_REGISTRY
        if env_id not in registry:
            raise ValueError(f"TextArenaEnv: unknown textarena env id {env_id!r}; single-player games "
                             f"that run offline include {', '.join(_EXAMPLES)} (all {len(registry)} ids: "
                             f"{some([k for k in registry if not k.endswith(('-raw', '-train'))], 8)})")
        if seed_by not in ("index", "episode"):
            raise ValueError(f"TextArenaEnv: seed_by is {seed_by!r}; use 'index' (same game for every "
                             "sample of a task) or 'episode' (task['seed'])")
        spec = registry[env_id]
        entry = spec.entry_point
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            entry = getattr(importlib.import_module(module), name)
        self.env_id, self.seed, self.seed_by = env_id, int(seed), seed_by
        self.system_prompt, self.format_actions = system_prompt, format_actions
        self.game = entry(**{**spec.kwargs, **dict(env_kwargs or {})})
        self._rng: tuple | None = None
        self._done = True

    def _call(self, fn, *args, **kwargs):
        """Run ``fn`` with this episode's own ``random`` state swapped in."""
        with _RANDOM_LOCK:
            outside = random.getstate()
            try:
                if self._rng is not None:
                    random.setstate(self._rng)
                return fn(*args, **kwargs)
            finally:
                self._rng = random.getstate()
                random.setstate(outside)

    def _observe(self) -> str:
        # One player: every PLAYER_ACTION is the model's own move (some games, TowerOfHanoi among
        # them, log it as sent by the game), and the chat holds it already as generated.
        _player, messages = self._call(self.game.get_observation)
        action = importlib.import_module("textarena").ObservationType.PLAYER_ACTION
        return "\n".join(m for _sender, m, kind in messages if kind != action)

    def reset(self, task: Mapping[str, Any]) -> list[dict[str, Any]]:
        game_seed = self.seed + int(task.get("index", 0)) if self.seed_by == "index" else int(task["seed"])
        self._rng = None                             # reset seeds the global random itself
        try:
            self._call(self.game.reset, num_players=1, seed=game_seed)
        except AssertionError as e:
            raise ValueError(f"TextArenaEnv plays single-player games only; {self.env_id} refused one "
                             f"player ({e}); try {', '.join(_EXAMPLES)}") from e
        self._done = False
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": self._observe()}]

    def step(self, text: str) -> Step:
        if self._done:
            raise RuntimeError("TextArenaEnv.step after the game ended (or before reset)")
        action = text
        if self.format_actions and "[" not in text and "]" not in text:
            action = f"[{text}]"
        done, info = self._call(self.game.step, action)
        info = dict(info or {})
        if not done:
            seen = self._observe()
            return Step(messages=[{"role": "user", "content": seen}] if seen else [], info=info)
        self._done = True
        rewards, game_info = self._call(self.game.close)
        info.update((game_info or {}).get(0, {}))
        return Step(reward=float((rewards or {}).get(0, 0.0)), done=True, info=info)
