"""Optional extras: which package belongs to which `flowrl[extra]`, what a graph needs, and what is missing.

    extra_for(exc)           # ('transformers', 'hf') for a ModuleNotFoundError of transformers
    missing(spec)            # [Need('rollout', 'engine `vllm`', 'vllm', 'vllm')] when vllm is not installed

Heavy integrations are extras in pyproject (`pip install 'flowrl[hf]'`) imported lazily; a command
that reaches one that is not installed names the extra and the install command, never a traceback.
`missing(spec)` looks at a graph before anything starts (find_spec: nothing is imported).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

from flowrl.graph.spec import GraphSpec

MODULE_EXTRA = {
    "transformers": "hf", "ray": "ray", "matplotlib": "report", "peft": "lora", "vllm": "vllm",
    "datasets": "data", "pyarrow": "data", "tensorboard": "logging", "wandb": "logging", "reasoning_gym": "gym",
    "openai": "agents", "aiohttp": "agents", "verifiers": "agents", "textarena": "agents", "skyrl_gym": "agents",
    "math_verify": "rewards",
}
"""Top-level module -> the extra of pyproject `[project.optional-dependencies]` that installs it."""


def install(extra: str) -> str:
    return f"pip install 'flowrl[{extra}]'"


def extra_for(exc: BaseException) -> tuple[str, str] | None:
    """(missing module, extra) when `exc` or an exception it was raised from or during is a
    ModuleNotFoundError of a package an extra installs; (module or '', extra) when it is one of
    flowrl's own ImportErrors naming the extra (`pip install 'flowrl[hf]'`)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ModuleNotFoundError) and e.name and e.name.split(".")[0] in MODULE_EXTRA:
            top = e.name.split(".")[0]
            return top, MODULE_EXTRA[top]
        e = e.__cause__ or e.__context__
    named = re.search(r"flowrl\[([a-z][a-z0-9-]*)\]", str(exc)) if isinstance(exc, ImportError) else None
    return ("", named.group(1)) if named else None


@dataclass(frozen=True)
class Need:
    """`where` (a node or a graph section) uses `what`, which needs `module` from `extra`."""

    where: str
    what: str
    module: str
    extra: str

    def text(self, command: str) -> str:
        return (f"{command}: {self.where} uses {self.what}, which needs the '{self.extra}' extra ({self.module} is not "
                f"installed): {install(self.extra)}")


def graph_needs(spec: GraphSpec) -> list[Need]:
    """Every extra the graph's nodes and sections use (engines, HF models, LoRA, metrics sinks, Ray)."""
    out: list[Need] = []
    for name, node in spec.nodes.items():
        config = node.config if isinstance(node.config, dict) else {}
        engine, model = config.get("engine"), config.get("model")
        if isinstance(engine, dict) and engine.get("type") == "vllm":
            out.append(Need(f"node `{name}`", "engine `vllm`", "vllm", "vllm"))
        if isinstance(engine, dict) and engine.get("type") == "hf":
            out.append(Need(f"node `{name}`", "engine `hf`", "transformers", "hf"))
        if isinstance(model, dict) and model.get("type") == "hf":
            out.append(Need(f"node `{name}`", "model type `hf`", "transformers", "hf"))
        train = config.get("train")
        if isinstance(train, dict) and train.get("lora"):
            out.append(Need(f"node `{name}`", "`train.lora`", "peft", "lora"))
    metrics = getattr(spec, "metrics", None)
    for sink in ("tensorboard", "wandb"):
        if getattr(metrics, sink, False):
            out.append(Need("`metrics`", f"`{sink}: true`", sink, "logging"))
    if getattr(getattr(spec, "launcher", None), "type", None) == "ray":
        out.append(Need("`launcher`", "`type: ray`", "ray", "ray"))
    return out


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken package
        return False


def missing(spec: GraphSpec) -> list[Need]:
    """The extras the graph uses that are not installed here (nothing is imported). Under the Ray
    launcher node processes run on the cluster's machines: only what this one runs (the launcher,
    the metrics sinks) must be installed here."""
    remote = getattr(getattr(spec, "launcher", None), "type", None) == "ray"
    return [n for n in graph_needs(spec) if not installed(n.module) and not (remote and n.where.startswith("node"))]


def notes(spec: GraphSpec, local: bool) -> list:
    """`extra-missing` notes for `flowrl check` planning on this machine (where the run would start;
    a declared or Ray inventory describes machines that may have the extra)."""
    from flowrl.placement.findings import Finding

    if not local:
        return []
    return [Finding("extra-missing", n.where.split("`")[1] if n.where.startswith("node") else None,
                    f"{n.text('flowrl run')}; `flowrl run` here stops before starting anything. Fix: "
                    f"{install(n.extra)}, or run where it is installed") for n in missing(spec)]
