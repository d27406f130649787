"""flowrl next to TRL's GRPOTrainer: the same job, the same algorithm settings, back to back.

    pip install 'flowrl[bench]'                     # TRL (and accelerate, transformers, datasets)
    python benchmarks/vs_trl.py                     # every row, 700 steps each (~10-12 min on 2 cores)
    python benchmarks/vs_trl.py --quick             # smoke run: 20 steps each
    python benchmarks/vs_trl.py --rows trl loop --json vs_trl.json
    python benchmarks/vs_trl.py --ablation --seeds 0 1 2 --jobs 2   # what each setting costs in steps

The job (the issue's): GRPO on 6-digit reversal, a 2-layer, 128-wide, 4-head decoder, 8 prompts x 8
samples per step, beta 0 (no reference, no KL), lr 1e-3, one optimizer step per batch. The rows:

- ``trl``: TRL's ``GRPOTrainer`` in this process, one thread (``torch.set_num_threads(1)``): a
  transformers ``GPT2LMHeadModel`` of that size (dropout 0, see below) over a one-character-per-token
  tokenizer of flowrl's task vocabulary, a dataset of the very prompts flowrl's task yields for the
  seed, flowrl's ``task.score`` as the reward function, TRL's defaults for everything else (loss
  ``dapo``, ``scale_rewards="group"``, epsilon 0.2, AdamW (0.9, 0.999), linear lr decay over
  ``max_steps``, gradient norm 1), fp32, no gradient checkpointing, no logging, saving or eval;
- ``matched-k0`` / ``matched-k1``: ``flowrl run graphs/grpo-matched.yaml`` (TRL's settings, see that
  file and docs/vs-trl.md) with ``schedule.max_staleness`` 0 / 1, every role its own process on the
  machine's cores;
- ``default``: ``flowrl run graphs/grpo.yaml`` as shipped (a reference and a KL loss, an entropy
  bonus, 4 mini-batches), k=0;
- ``loop``: ``flowrl.rl.single_process.run`` with the matched settings (read from
  graphs/grpo-matched.yaml), one thread: flowrl's own trainer without the dataflow.

Every row runs ``--steps`` steps (a cap, so the script ends; the matched rows' lr decays to 0 at the
cap, as TRL's does at ``max_steps``). Columns and clocks are benchmarks/e2e.py's (its docstring):
completions/s over the training time, seconds and step to the first batch-mean reward >= 0.95, the
mean reward of the last 10 steps. The TRL row's clock starts before its model, tokenizer and
trainer are built (like the loop's), its steps end at TRL's ``on_step_end``, and its reward per step is the
mean score of the step's 64 completions, recorded by the reward function.

``--ablation`` runs the one-process loop to the threshold from the matched settings, one change at a
time (toward flowrl's defaults, or toward the other aggregations), for each of ``--seeds``, and
prints the steps each needed; ``--trl-ablation`` adds TRL runs with its own settings changed (constant
lr, beta2 0.99, GPT-2's default dropout 0.1). Timings on the small shared machine are noisy: read the
step counts, and repeat before trusting a 10 % difference in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import e2e  # noqa: E402  (the flowrl runs, the summary and the table are e2e's)
from flowrl.graph import load_graph  # noqa: E402

MATCHED_GRAPH = ROOT / "graphs" / "grpo-matched.yaml"
DEFAULT_GRAPH = ROOT / "graphs" / "grpo.yaml"
ROWS = ("trl", "matched-k0", "matched-k1", "default", "loop")


# ----------------------------------------------------------------------------------- the matched job
def matched_config(*, seed: int, steps: int, overrides: list[str] = ()) -> Any:
    """The one-process loop's config with graphs/grpo-matched.yaml's task, model, batch and trainer
    settings (read from the file, so the loop and the graph cannot drift), the lr decaying to 0 at
    ``steps``; ``overrides`` (``key.path=value``) applied last."""
    import yaml

    from flowrl.rl.config import ActorConfig, AdvantageConfig, RolloutConfig
    from flowrl.rl.single_process import LoopConfig, apply_overrides

    graph = yaml.safe_load(MATCHED_GRAPH.read_text())
    nodes = graph["nodes"]
    train = {**nodes["actor"]["config"]["train"], "lr_decay_steps": steps}
    cfg = LoopConfig(
        algo="grpo",
        task=nodes["prompts"]["config"]["task"],
        model=nodes["actor"]["config"]["model"],
        rollout=RolloutConfig(prompts_per_step=graph["schedule"]["batch_size"],
                              samples_per_prompt=nodes["rollout"]["config"]["samples_per_prompt"]),
        actor=ActorConfig.model_validate(train),
        advantage=AdvantageConfig(estimator="grpo", **nodes["advantages"].get("config", {})),
        steps=steps, seed=seed,
    )
    return apply_overrides(cfg, list(overrides))


# --------------------------------------------------------------------------------------------- TRL
def trl_tokenizer() -> Any:
    """A fast tokenizer with one token per character of flowrl's task vocabulary, ids as flowrl's."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flowrl.tasks import VOCAB_SIZE, decode

    symbols = decode(range(VOCAB_SIZE))
    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(symbols)}, unk_token=decode([0])))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    from flowrl.tasks import BOS, EOS, PAD

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=decode([BOS]), eos_token=decode([EOS]),
                                   pad_token=decode([PAD]))


def bench_trl(*, seed: int, steps: int, threshold: float, dropout: float = 0.0, stop_at_threshold: bool = False,
              label: str = "TRL GRPOTrainer (1 thread)", out_dir: str | None = None, **config: Any) -> dict:
    """TRL's GRPOTrainer on the job; ``config``: GRPOConfig fields on top of the matched ones."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flowrl.tasks import BOS, EOS, PAD, VOCAB_SIZE, build_task, decode

    torch.set_num_threads(1)
    task = build_task({"name": "reverse", "digits": 6})
    n_prompts, group, max_new = 8, 8, task.max_new_tokens
    t0 = time.perf_counter()
    prompts, targets = task.prompts(seed, 0, steps * n_prompts)
    dataset = Dataset.from_dict({"prompt": [decode(p) for p in prompts.tolist()], "target": targets.tolist()})
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=64, n_embd=128, n_layer=2, n_head=4,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD))
    rewards: list[float] = []
    tokens: list[int] = []

    def reward(prompts, completions, completion_ids, target, **_) -> list[float]:
        # completion_ids: each completion's tokens up to and including its EOS (TRL's completion mask)
        resp = torch.full((len(completion_ids), max_new), PAD, dtype=torch.long)
        for i, ids in enumerate(completion_ids):
            resp[i, :len(ids)] = torch.tensor(ids[:max_new], dtype=torch.long)
        scores = task.score(resp, torch.tensor(target, dtype=torch.long))
        rewards.append(float(scores.mean()))
        tokens.append(sum(len(ids) for ids in completion_ids) + len(completion_ids) * task.prompt_len)
        return scores.tolist()

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **_):
            ends.append(time.perf_counter() - t0)
            if stop_at_threshold and rewards and rewards[-1] >= threshold:
                control.should_training_stop = True

    with tempfile.TemporaryDirectory(prefix="flowrl-vs-trl-") as tmp:
        args = GRPOConfig(**{
            "output_dir": out_dir or tmp, "per_device_train_batch_size": n_prompts * group,
            "num_generations": group, "max_completion_length": max_new, "learning_rate": 1e-3, "beta": 0.0,
            "max_steps": steps, "seed": seed, "bf16": False, "gradient_checkpointing": False, "use_cpu": True,
            "report_to": "none", "save_strategy": "no", "logging_strategy": "no", "eval_strategy": "no",
            "disable_tqdm": True, "dataloader_num_workers": 0, **config})
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=trl_tokenizer(), callbacks=[Clock()])
        trainer.train()
    wall = time.perf_counter() - t0
    n = min(len(ends), len(rewards))
    curve = [(i + 1, ends[i], rewards[i], float(n_prompts * group), float(tokens[i])) for i in range(n)]
    settings = {k: str(getattr(args, k)) for k in (
        "loss_type", "scale_rewards", "epsilon", "epsilon_high", "beta", "num_iterations", "lr_scheduler_type",
        "learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm", "optim",
        "temperature", "top_p", "top_k", "mask_truncated_completions", "bf16", "gradient_checkpointing")}
    return e2e.summarize(label, curve, threshold, train_s=curve[-1][1], startup_s=None, wall_s=wall, cores=1,
                         extra={"threads": 1, "dropout": dropout, "trl_settings": settings})


# ------------------------------------------------------------------------------------------ flowrl
def bench_loop(*, seed: int, steps: int, threshold: float, overrides: list[str] = (),
               stop_at_threshold: bool = False, label: str = "flowrl one-process loop, matched (1 thread)") -> dict:
    import torch

    from flowrl.rl.single_process import run

    torch.set_num_threads(1)
    cfg = matched_config(seed=seed, steps=steps, overrides=overrides)
    if stop_at_threshold:
        cfg = cfg.model_copy(update={"target_reward": threshold})
    t0 = time.perf_counter()
    rows = run(cfg)
    wall = time.perf_counter() - t0
    curve = [(int(r["step"]), float(r["wall_s"]), float(r["reward_mean"]), float(r["samples"]), float(r["tokens"]))
             for r in rows]
    return e2e.summarize(label, curve, threshold, train_s=curve[-1][1], startup_s=None, wall_s=wall, cores=1,
                         extra={"threads": 1, "overrides": list(overrides)})


def bench_graph(*, graph: Path, label: str, seed: int, steps: int, threshold: float, k: int | None, run_dir: Path,
                timeout_s: float) -> dict:
    """``flowrl run GRAPH`` for ``steps`` at ``max_staleness=k`` (None: the graph's own; e2e's flowrl run). The
    matched graph's lr decay is stretched to ``steps`` (a copy of the file next to the run directory)."""
    if graph == MATCHED_GRAPH:
        text = graph.read_text()
        assert "lr_decay_steps: 700" in text, "graphs/grpo-matched.yaml must set lr_decay_steps: 700"
        graph = run_dir.parent / f"{run_dir.name}.yaml"
        graph.write_text(text.replace("lr_decay_steps: 700", f"lr_decay_steps: {steps}"))
    res = e2e.bench_flowrl(seed=seed, steps=steps, threshold=threshold, k=k, run_dir=run_dir, timeout_s=timeout_s,
                           graph=graph)
    return {**res, "run": label, "graph": label.split()[1]}


def run_rows(rows: list[str], *, seed: int, steps: int, threshold: float, timeout_s: float,
             keep: str | None = None) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="flowrl-vs-trl-") as tmp:
        runs = Path(keep) if keep else Path(tmp)
        runs.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for row in rows:
            common = {"seed": seed, "steps": steps, "threshold": threshold}
            if row == "trl":
                res = bench_trl(**common)
            elif row == "loop":
                res = bench_loop(**common)
            elif row.startswith("matched"):
                k = int(row[-1])
                res = bench_graph(graph=MATCHED_GRAPH, label=f"flowrl grpo-matched.yaml (k={k})", k=k,
                                  run_dir=runs / f"vs-trl-{row}-{stamp}", timeout_s=timeout_s, **common)
            else:
                k = load_graph(DEFAULT_GRAPH).schedule.max_staleness
                res = bench_graph(graph=DEFAULT_GRAPH, label=f"flowrl grpo.yaml (default, k={k})", k=None,
                                  run_dir=runs / f"vs-trl-{row}-{stamp}", timeout_s=timeout_s, **common)
            results.append(res)
            e2e._progress(res)
    return results


def print_comparison(results: list[dict], threshold: float) -> None:
    e2e.print_table(results, threshold)
    trl = next((r for r in results if r["run"].startswith("TRL")), None)
    if trl is None:
        return
    for r in results:
        if r is trl:
            continue
        speed = r["completions_per_s"] / trl["completions_per_s"]
        steps = (f"{r['step_to_threshold'] / trl['step_to_threshold']:.2f}x TRL's steps to {threshold:g}"
                 if r["reached"] and trl["reached"] else f"steps to {threshold:g}: not comparable (not reached)")
        print(f"{r['run']}: {speed:.2f}x TRL's completions/s, {steps}")


# ---------------------------------------------------------------------------------------- ablation
ABLATION: dict[str, tuple[str, list[str]]] = {  # name: (what changes from the matched settings, overrides)
    "matched": ("matched (TRL's settings)", []),
    "beta2": ("AdamW beta2 0.99 (flowrl's default)", ["actor.betas=[0.9, 0.99]"]),
    "const-lr": ("constant lr (flowrl's default)", ["actor.lr_decay_steps=null"]),
    "untied": ("untied embeddings (flowrl's default)", ["model.tie_embeddings=false"]),
    "flowrl-defaults": ("all three flowrl defaults (the issue's 'same settings')",
                        ["actor.betas=[0.9, 0.99]", "actor.lr_decay_steps=null", "model.tie_embeddings=false"]),
    "loss-grpo": ("loss grpo (seq_mean_token_mean)", ["actor.loss_agg=grpo"]),
    "loss-dr_grpo": ("loss dr_grpo (seq_mean_token_sum_norm, L=7)", ["actor.loss_agg=dr_grpo", "actor.loss_agg_norm_len=7"]),
    "no-std": ("advantages not std-scaled (Dr. GRPO)", ["advantage.normalize_std=false"]),
    "no-clip-grad": ("no gradient-norm clipping", ["actor.max_grad_norm=null"]),
}
TRL_ABLATION: dict[str, tuple[str, dict]] = {  # name: (label, bench_trl keyword arguments)
    "trl": ("TRL as in the rows", {}),
    "trl-const-lr": ("TRL constant lr", {"lr_scheduler_type": "constant"}),
    "trl-beta2": ("TRL AdamW beta2 0.99", {"adam_beta2": 0.99}),
    "trl-dropout": ("TRL, GPT-2 dropout 0.1 (transformers' default)", {"dropout": 0.1}),
}


def _ablation_job(job: tuple) -> tuple[str, int, int | None, float]:
    kind, name, seed, steps, threshold = job
    if kind == "loop":
        res = bench_loop(seed=seed, steps=steps, threshold=threshold, overrides=ABLATION[name][1],
                         stop_at_threshold=True)
    else:
        res = bench_trl(seed=seed, steps=steps, threshold=threshold, stop_at_threshold=True, **TRL_ABLATION[name][1])
    return name, seed, res["step_to_threshold"], res["curve"][-1][1]


def run_ablation(*, seeds: list[int], steps: int, threshold: float, jobs: int, trl: bool,
                 variants: list[str] | None = None, trl_variants: list[str] | None = None) -> list[dict]:
    names = variants or list(ABLATION)
    trl_names = (trl_variants or list(TRL_ABLATION)) if trl else []
    work = [("loop", n, s, steps, threshold) for n in names for s in seeds]
    work += [("trl", n, s, steps, threshold) for n in trl_names for s in seeds]
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(jobs) as pool:
            done = []
            for out in pool.imap_unordered(_ablation_job, work):
                done.append(out)
                print(f"  {out[0]}, seed {out[1]}: {out[2] or f'>{steps}'} steps", file=sys.stderr, flush=True)
    else:
        done = []
        for job in work:
            done.append(_ablation_job(job))
            print(f"  {done[-1][0]}, seed {done[-1][1]}: {done[-1][2] or f'>{steps}'} steps", file=sys.stderr, flush=True)
    table = []
    for name in names + trl_names:
        per_seed = {s: st for n, s, st, _ in done if n == name}
        counted = [per_seed[s] if per_seed[s] is not None else steps + 1 for s in seeds]
        label, change = ABLATION[name] if name in ABLATION else TRL_ABLATION[name]
        table.append({"variant": name, "label": label, "steps_per_seed": [per_seed[s] for s in seeds],
                      "median_steps": statistics.median(counted), "change": change})
    return table


def print_ablation(table: list[dict], seeds: list[int], steps: int, threshold: float) -> None:
    base = table[0]["median_steps"]
    head = ["variant", *[f"seed {s}" for s in seeds], "median", "vs matched"]
    cells = [head] + [[r["label"], *[str(x) if x is not None else f">{steps}" for x in r["steps_per_seed"]],
                       f"{r['median_steps']:g}", f"{r['median_steps'] / base:.2f}x"] for r in table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    print(f"steps to a batch-mean reward of {threshold:g} (cap {steps})")
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 steps each (the threshold is not reached)")
    parser.add_argument("--steps", type=int, default=None, help="step cap per row (default 700, --quick 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=0.95, help="batch-mean reward to time (default 0.95)")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="which rows, in this order")
    parser.add_argument("--keep", metavar="DIR", help="keep the flowrl run directories under DIR")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per flowrl run before it is killed")
    parser.add_argument("--json", metavar="FILE", help="also write the results (with reward curves) as JSON")
    parser.add_argument("--ablation", action="store_true", help="the ablation of the one-process loop instead")
    parser.add_argument("--trl-ablation", action="store_true", help="with --ablation: TRL runs with changed settings too")
    parser.add_argument("--variants", nargs="+", choices=list(ABLATION),
                        help="with --ablation: only these variants (default all)")
    parser.add_argument("--trl-variants", nargs="+", choices=list(TRL_ABLATION),
                        help="with --trl-ablation: only these TRL variants (default all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="with --ablation (default 0 1 2)")
    parser.add_argument("--jobs", type=int, default=1, help="with --ablation: runs at once, one thread each")
    args = parser.parse_args(argv)
    steps = args.steps or (20 if args.quick else 700)

    if args.ablation:
        table = run_ablation(seeds=args.seeds, steps=steps, threshold=args.threshold, jobs=args.jobs,
                             trl=args.trl_ablation, variants=args.variants, trl_variants=args.trl_variants)
        print_ablation(table, args.seeds, steps, args.threshold)
        out = {"mode": "ablation", "seeds": args.seeds, "steps": steps, "threshold": args.threshold, "results": table}
    else:
        results = run_rows(args.rows, seed=args.seed, steps=steps, threshold=args.threshold, timeout_s=args.timeout,
                           keep=args.keep)
        print_comparison(results, args.threshold)
        out = {"mode": "rows", "seed": args.seed, "steps": steps, "threshold": args.threshold, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
