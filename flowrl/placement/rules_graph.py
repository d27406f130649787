"""Rules about the graph itself, read with the node classes: dtypes on edges, weights nobody
takes, replicas of stateful nodes.

- `dtype-mismatch`: only tensors that cross an edge matter. The built-in nodes pass token ids
  (int64), masks (bool) and scores, log-probabilities and values in float32 whatever their compute
  dtype, so bf16 on A100s next to fp16 on V100s is fine. A node class whose output ports carry
  tensors in its compute dtype (hidden states, logits) says so with
  `compute_dtype_outputs = ("out",)`; an edge from such a port into a node computing in another
  dtype is worth a warning: an op mixing the two fails unless the consumer casts. Between a
  float16 and a bfloat16 node, any edge (data or `weights:`) of nodes with a role is an error: the
  two formats round differently and bf16's range does not fit fp16's (weights or hidden states
  above 65,504 become inf), so samples and log-probs of one are trained on under the other's
  numerics (a training-inference mismatch that grows), or weights arrive broken.
- `no-weight-subscriber`: a node class with `publishes_weights` and no `weights:` edge from it, in a
  graph with no node that takes weights: it trains a policy that nobody samples with.
- `unfed-subscriber`: a node that takes weights (`subscribes_weights`, a rollout) with no `weights:`
  edge into it while a trainer publishes: each ticket needs a policy version it would never get,
  so the run would wait at its version gate for ever.
- `stateful-replicas`: replicas of a stateful node (`stateful = True`) each train their own copy on
  a share of the tickets: unrelated models. Data parallelism is `devices: N` (one model, each batch
  split over the ranks). A class that declares how its replicas merge (`merge_replicas`, any value
  but None) may have them.
- `concurrency-unsupported`: `concurrency > 1` on a stateful node (its state takes tickets one at a
  time, in order) or on a node whose replicas span several ranks (every rank must make the same
  collectives in the same order): either would break the exactly-once or the collective order.
"""

from __future__ import annotations

from flowrl.graph.spec import GraphSpec
from flowrl.placement.findings import Finding


HALF = {"float16", "bfloat16"}


def _half_pair(spec: GraphSpec, classes: dict[str, type], src: str, dst: str) -> bool:
    """Both ends hold a model (have a role or trade weights) and compute in different half formats."""
    def modeled(name: str) -> bool:
        cls = classes.get(name)
        return bool(getattr(cls, "role", None) or getattr(cls, "publishes_weights", False)
                    or getattr(cls, "subscribes_weights", False))
    a, b = spec.nodes[src].dtype, spec.nodes[dst].dtype
    return {a, b} == HALF and modeled(src) and modeled(dst)


def _half_finding(edge, kind: str, a: str, b: str, src: str, dst: str) -> Finding:
    return Finding("dtype-mismatch", dst,
                   f"{kind} {edge}: `{src}` computes in {a} and `{dst}` in {b}. The two half formats round "
                   "differently and bfloat16's range does not fit float16's (values above 65,504 become inf), so "
                   "what one samples or sends is used under the other's numerics: log-prob ratios drift and "
                   "synced weights can overflow. Fix: give both nodes the same `dtype:` — `float16` on both "
                   "(runs on every GPU; needs loss scaling to train), `bfloat16` on both (GPUs of compute "
                   "capability 8.0+), or `float32` on the node whose GPUs lack bfloat16", severity="error")


def _dtypes(spec: GraphSpec, classes: dict[str, type]) -> list[Finding]:
    out = []
    for edge in spec.edges:
        if edge.src not in spec.nodes or edge.dst not in spec.nodes:
            continue
        a, b = spec.nodes[edge.src].dtype, spec.nodes[edge.dst].dtype
        if _half_pair(spec, classes, edge.src, edge.dst):
            out.append(_half_finding(edge, "edge", a, b, edge.src, edge.dst))
            continue
        cls = classes.get(edge.src)
        ports = tuple(getattr(cls, "compute_dtype_outputs", ()) or ())
        outputs = tuple(getattr(cls, "outputs", ()) or ())
        port = edge.src_port or (outputs[0] if len(outputs) == 1 else None)
        if port not in ports:
            continue  # int64 / bool / float32 tensors: fp32 next to a half format is fine
        if a != b:
            out.append(Finding("dtype-mismatch", edge.dst,
                               f"edge {edge}: `{edge.src}` sends its `{port}` tensors in its compute dtype {a}, but "
                               f"`{edge.dst}` computes in {b}; an op that mixes them fails (`expected scalar type ...`) "
                               f"unless `{edge.dst}` casts its inputs. Fix: give both nodes the same `dtype:` (e.g. "
                               f"`dtype: {a}` on `{edge.dst}`), or cast the inputs in `{edge.dst}`"))
    for w in spec.weights:
        if w.src in spec.nodes and w.dst in spec.nodes and _half_pair(spec, classes, w.src, w.dst):
            out.append(_half_finding(w, "weights edge", spec.nodes[w.src].dtype, spec.nodes[w.dst].dtype, w.src, w.dst))
    return out


def _subscribers(spec: GraphSpec, classes: dict[str, type]) -> list[Finding]:
    out = []
    sources, fed = {w.src for w in spec.weights}, {w.dst for w in spec.weights}
    trainers = [n for n, c in classes.items() if getattr(c, "publishes_weights", False)]
    takers = [n for n, c in classes.items() if getattr(c, "subscribes_weights", False)]
    for name in trainers:
        if name not in sources and not takers:
            out.append(Finding("no-weight-subscriber", name,
                               f"node `{name}` trains and publishes weights, but no node takes them: the samples it "
                               "trains on never come from the policy it learns. Fix: add a node that takes weights "
                               f"(e.g. `kind: rollout`) and `weights: [{name} -> that node]`"))
    for name in takers:
        if trainers and name not in fed:
            out.append(Finding("unfed-subscriber", name,
                               f"node `{name}` takes weights, but no `weights:` edge leads to it while `{trainers[0]}` "
                               f"publishes: every ticket after the first {spec.schedule.max_staleness + 1} needs a "
                               f"policy version `{name}` never gets, and the run would wait for it for ever. Fix: "
                               f"add `weights: [{trainers[0]} -> {name}]`"))
    return out


def _replicas(spec: GraphSpec, classes: dict[str, type]) -> list[Finding]:
    out = []
    for name, node in spec.nodes.items():
        cls = classes.get(name)
        if node.replicas > 1 and getattr(cls, "stateful", False) and getattr(cls, "merge_replicas", None) is None:
            n = node.replicas
            per = node.devices if isinstance(node.devices, int) else 1
            out.append(Finding("stateful-replicas", name,
                               f"node `{name}` is stateful and has replicas: {n}; each replica would keep its own "
                               f"state (train its own model) on 1/{n} of the tickets: {n} unrelated models. Fix: use "
                               f"devices: {n * per} for data-parallel training (one model, each batch split over the "
                               "ranks) and `replicas: 1`, or declare how the replicas merge (`merge_replicas` on "
                               f"{getattr(cls, '__name__', 'the class')})"))
    return out


def _concurrency(spec: GraphSpec, classes: dict[str, type]) -> list[Finding]:
    out = []
    for name, node in spec.nodes.items():
        if node.concurrency == 1:
            continue
        cls = classes.get(name)
        per = node.devices if isinstance(node.devices, int) else \
            len(node.devices) // node.replicas if isinstance(node.devices, list) else 1
        if getattr(cls, "stateful", False):
            why, fix = "it is stateful: its state takes tickets one at a time, in ticket order", \
                "remove `concurrency` (it is for stateless nodes whose calls overlap, like a rollout)"
        elif per > 1:
            why = f"each replica spans {per} ranks, which must make the same collectives in the same order"
            fix = f"remove `concurrency`, or use `devices: 1` and `replicas: {per}`"
        else:
            continue
        out.append(Finding("concurrency-unsupported", name,
                           f"node `{name}` has concurrency: {node.concurrency}, but {why}. Fix: {fix}"))
    return out


def check(spec: GraphSpec, classes: dict[str, type]) -> list[Finding]:
    return _dtypes(spec, classes) + _subscribers(spec, classes) + _replicas(spec, classes) + _concurrency(spec, classes)
