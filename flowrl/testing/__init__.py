"""Test support: run graphs for real with faults and audit their ledgers; synthetic nodes."""

from flowrl.runtime.protocol.checkpoints import node_checkpoint, node_state
from flowrl.testing.harness import Audit, RunResult, audit_ledger, descendants, read_jsonl, run_graph

__all__ = ["Audit", "RunResult", "audit_ledger", "descendants", "node_checkpoint", "node_state", "read_jsonl",
           "run_graph"]
