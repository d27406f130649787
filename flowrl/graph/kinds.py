"""Node kinds: built-in names and `module:Class` import paths, resolved to Node classes.

Resolving imports the node's module; node modules keep heavy imports out of module level so that
`flowrl check` stays fast.
"""

from __future__ import annotations

import difflib
import importlib
import re

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$", re.ASCII)

BUILTIN_KINDS: dict[str, str] = {
    "prompts": "flowrl.nodes.prompts:Prompts",
    "rollout": "flowrl.nodes.rollout:Rollout",
    "reward": "flowrl.nodes.reward:Reward",
    "reward_model": "flowrl.nodes.reward:RewardModel",
    "reference": "flowrl.nodes.reference:Reference",
    "critic": "flowrl.nodes.critic:Critic",
    "actor": "flowrl.nodes.actor:Actor",
    "group_advantages": "flowrl.nodes.advantages:GroupAdvantages",
    "dataset": "flowrl.nodes.dataset:Dataset",
    "rewards": "flowrl.nodes.rewards:Rewards",
    "dapo_filter": "flowrl.nodes.dapo:DapoFilter",
    "evaluator": "flowrl.nodes.evaluator:Evaluator",
    "agent": "flowrl.nodes.agent:Agent",
}


class KindError(ValueError):
    """A node kind that cannot be resolved; the message says why and what would work."""


def import_path(kind: str) -> str:
    """`rollout` -> `flowrl.nodes.rollout:Rollout`; import paths pass through."""
    if kind in BUILTIN_KINDS:
        return BUILTIN_KINDS[kind]
    if ":" in kind:
        if not _IMPORT_PATH.match(kind):
            shown = kind if len(kind) <= 100 else kind[:80] + "..."
            raise KindError(f"kind {shown!r} is not an import path 'package.module:ClassName' (dotted names of "
                            "letters, digits and _, one ':' before the class)")
        return kind
    close = difflib.get_close_matches(kind, BUILTIN_KINDS, n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    raise KindError(
        f"unknown kind {kind!r}; {hint}built-in kinds are {', '.join(sorted(BUILTIN_KINDS))}, "
        "or give your own node as 'package.module:ClassName'"
    )


def resolve_kind(kind: str) -> type:
    """Import and return the Node class for `kind`."""
    from flowrl.node import Node

    path = import_path(kind)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or the module's own code failing at import
        if not isinstance(e, ImportError):
            raise KindError(f"kind {kind!r}: importing module {module_name!r} raised {type(e).__name__}: {e}; "
                            "fix that module (its import must not fail)") from None
        raise KindError(
            f"kind {kind!r}: cannot import module {module_name!r} ({e}); check the spelling and that "
            "the module is on PYTHONPATH (run flowrl from the folder that holds the package)"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        names = [n for n in dir(module) if isinstance(getattr(module, n), type)]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KindError(f"kind {kind!r}: module {module_name!r} has no class {attr!r}{hint}")
    if not (isinstance(cls, type) and issubclass(cls, Node)):
        raise KindError(f"kind {kind!r}: {path} is not a subclass of flowrl.Node")
    return cls
