"""Environments from other RL libraries, seen as flowrl agent environments.

    # graph.yaml: a SkyRL-Gym env as an agent node's environment
    - name: agent
      kind: agent
      config:
        env: "flowrl.agents.adapters.skyrl:SkyRLEnv"
        env_config: {env_id: gsm8k, tasks: data/gsm8k.parquet}

Each adapter is one module that imports its library only when an environment is built, so loading
a graph or ``flowrl check`` never pays for it:

- :mod:`~flowrl.agents.adapters.skyrl` -- ``SkyRLEnv``: SkyRL-Gym text envs (``init``/``step``);
- :mod:`~flowrl.agents.adapters.textarena` -- ``TextArenaEnv``: TextArena single-player games;
- :mod:`~flowrl.agents.adapters.verifiers` -- ``verifiers_agent``: a verifiers environment runs its
  own agent program against flowrl's OpenAI-compatible gateway (the agent-function path, not
  ``reset``/``step``: verifiers calls the model itself).

The libraries come with ``pip install 'flowrl[agents]'``. docs/agents-adapters.md lists the
environments that were tested and what each adapter cannot do.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = "pip install 'flowrl[agents]'"


def import_library(module: str, package: str, adapter: str) -> ModuleType:
    """Import ``module`` for ``adapter``, or say which package to install.

    >>> import_library("skyrl_gym", "skyrl-gym", "SkyRLEnv")   # doctest: +SKIP
    ImportError: SkyRLEnv needs skyrl-gym (import skyrl_gym failed: No module named 'skyrl_gym');
    install it with pip install 'flowrl[agents]' (or pip install skyrl-gym)
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{adapter} needs {package} (import {module} failed: {e}); install it with "
                          f"{INSTALL_HINT} (or pip install {package})") from e


def some(names, k: int = 12) -> str:
    """The first ``k`` of ``names`` (sorted), for an error message that lists valid choices."""
    names = sorted(names)
    more = f", ... ({len(names) - k} more)" if len(names) > k else ""
    return ", ".join(names[:k]) + more
