"""benchmarks/vs_trl.py keeps working: its TRL and one-process rows run, and the matched settings are TRL's.

The TRL parts are skipped where trl is not installed (``pip install 'flowrl[bench]'``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import vs_trl

ROOT = Path(__file__).resolve().parents[1]


def test_the_loop_runs_graphs_grpo_matched_settings():
    cfg = vs_trl.matched_config(seed=3, steps=50)
    a = cfg.actor
    assert (cfg.seed, cfg.steps, cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt) == (3, 50, 8, 8)
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads, cfg.model.tie_embeddings) == (128, 2, 4, True)
    assert (a.lr, a.lr_decay_steps, a.betas, a.mini_batches, a.epochs) == (1e-3, 50, (0.9, 0.999), 1, 1)
    assert (a.loss_agg, a.kl_loss_coef, a.entropy_coef, cfg.advantage.normalize_std) == ("token_mean", 0.0, 0.0, True)
    assert vs_trl.matched_config(seed=0, steps=50, overrides=["actor.betas=[0.9, 0.99]"]).actor.betas == (0.9, 0.99)


def test_the_matched_settings_are_trls_defaults():
    """If a TRL release changes a default, the matched graph (and docs/vs-trl.md) must follow."""
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to="none")
    a = vs_trl.matched_config(seed=0, steps=700).actor
    assert (args.loss_type, a.loss_agg) == ("dapo", "token_mean")
    assert args.scale_rewards == "group" and vs_trl.matched_config(seed=0, steps=1).advantage.normalize_std
    assert (args.epsilon, args.epsilon_high) in ((a.clip_low, None), (a.clip_low, a.clip_high))
    assert (args.beta, args.num_iterations, args.gradient_accumulation_steps) == (a.kl_loss_coef, a.epochs, 1)
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (*a.betas, a.eps)
    assert (args.weight_decay, args.max_grad_norm, args.warmup_steps) == (a.weight_decay, a.max_grad_norm, a.warmup_steps)
    assert str(args.lr_scheduler_type) in ("linear", "SchedulerType.LINEAR") and a.lr_decay_steps == 700
    assert (args.temperature, args.top_p, args.top_k, args.mask_truncated_completions) == (1.0, 1.0, 0, False)


@pytest.mark.timeout(150)
def test_the_benchmark_runs_its_trl_and_one_process_rows(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "vs_trl.json"
    proc = subprocess.run([sys.executable, "benchmarks/vs_trl.py", "--steps", "3", "--rows", "trl", "loop",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["run"].split()[0] for r in results] == ["TRL", "flowrl"]
    for r in results:
        assert r["steps"] == 3 and len(r["curve"]) == 3 and r["completions"] == 3 * 64
        assert r["completions_per_s"] > 0 and 0.0 <= r["reward_last10"] <= 1.0
    assert results[0]["trl_settings"]["loss_type"] == "dapo"
    assert "x TRL's completions/s" in proc.stdout
