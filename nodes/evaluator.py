"""Evaluator: scores a held-out set with the newest weights every N versions -- greedy and sampled.

    eval:
      kind: evaluator
      config: {path: examples/math/test.jsonl, template: "{question}=", model: *model,
               max_new_tokens: 3, every_versions: 10, samples: 4, terms: [{type: math}]}
    weights:
      - actor -> eval

An observer: it takes no tickets (no ports); the runtime loads each new weights version into it
and calls `observe(version)` (skipping versions that arrive while an evaluation runs), so eval
never counts as training work. Every `every_versions` versions it generates one greedy answer
(temperature 0) and `samples` sampled answers per held-out prompt, scores them with `terms`, and
sets gauges that become these metrics.jsonl / Prometheus / `flowrl report` keys:

    eval/reward_greedy    mean score of the greedy answers
    eval/reward_sampled   mean score of the sampled answers
    eval/pass@1, eval/pass@K   share of prompts solved (unbiased pass@k over `samples` draws;
                               a sample passes when its score >= pass_score)
    eval/version          the weights version these numbers belong to
"""

from pydantic import Field

import flowrl
from flowrl.nodes.dataset import DataConfig, load_data
from flowrl.rewards.terms import MathTerm, TermSpec


class Evaluator(flowrl.Node):
    inputs = ()
    outputs = ()
    subscribes_weights = True

    class Config(DataConfig):
        every_versions: int = Field(10, ge=1)
        """Evaluate the first version at or past each multiple of this (and version 0)."""
        limit: int | None = Field(None, ge=1)
        """Use only the first `limit` rows of the held-out file."""
        samples: int = Field(4, ge=1)
        """Sampled answers per prompt (the K of pass@K)."""
        temperature: float = Field(1.0, gt=0)
        top_p: float = Field(1.0, gt=0, le=1)
        terms: list[TermSpec] = Field(default_factory=lambda: [MathTerm()])
        """Reward terms that score an answer (as in the `rewards` node)."""
        pass_score: float = 1.0
        """A sample passes when its score is at least this."""
        batch_prompts: int = Field(64, ge=1)
        """Prompts per generate call."""

    async def setup(self):
        from flowrl.data import answer_text
        from flowrl.nodes.common import model_on

        c = self.config
        rows, self.tokenizer, builder = load_data(c)
        rows = rows[: c.limit] if c.limit else rows
        self.prompts = [builder.ids(r) for r in rows]
        self.answers = [answer_text(r[c.answer_field]) for r in rows]
        self.model = model_on(self.ctx, c.model)
        self.last = None

    def weights(self):
        return self.model.state_dict()  # live tensors: new versions are received in place

    async def observe(self, version: int):
        import anyio

        every = self.config.every_versions
        # the first version at or past each multiple: a sync may deliver a newer version than it was
        # ordered for (the newest the trainer holds), so an exact multiple can be skipped
        due = version % every == 0 if self.last is None else version // every > self.last // every
        if not due:
            return None
        result = await anyio.to_thread.run_sync(self.evaluate, version)
        self.last = version
        rec = self.ctx.recorder
        for key, value in result.items():
            rec.gauge("eval", value, metric=key)
        return result

    def evaluate(self, version: int) -> dict[str, float]:
        """Scores of the held-out set with the weights held now; {metric: value}."""
        import torch

        from flowrl.models import generate
        from flowrl.rewards.passk import pass_at_k
        from flowrl.rewards.terms import Inputs, score_terms

        c, tok, k = self.config, self.tokenizer, self.config.samples
        gen = torch.Generator(device=self.ctx.device).manual_seed(self.ctx.seed * 1_000_003 + version)
        greedy, sampled = [], []
        for start in range(0, len(self.prompts), c.batch_prompts):
            ids = self.prompts[start: start + c.batch_prompts]
            refs = self.answers[start: start + c.batch_prompts]
            prompts = flowrl.Ragged.from_sequences(ids, dtype="int64")  # each prompt its own length, no padding
            for temp, reps, out in ((0.0, 1, greedy), (c.temperature, k, sampled)):
                rows = torch.arange(len(ids)).repeat_interleave(reps).numpy()
                g = generate(self.model, prompts.select(rows), max_new_tokens=c.max_new_tokens,
                             temperature=temp, top_p=c.top_p, eos_id=tok.eos_id, pad_id=tok.pad_id, generator=gen)
                lengths = g.response_lens.tolist()
                texts = [tok.decode(r[:n].tolist()) for r, n in zip(g.responses(tok.pad_id), lengths)]
                _, scores = score_terms(c.terms, Inputs(texts, [a for a in refs for _ in range(reps)],
                                                        [int(n) for n in lengths], c.max_new_tokens))
                out.extend(scores)
        n = len(self.prompts)
        passed = [sum(s >= c.pass_score for s in sampled[i * k:(i + 1) * k]) for i in range(n)]
        result = {"reward_greedy": sum(greedy) / n, "reward_sampled": sum(sampled) / len(sampled),
                  "pass@1": sum(pass_at_k(k, p, 1) for p in passed) / n,
                  "version": float(version)}
        if k > 1:
            result[f"pass@{k}"] = sum(pass_at_k(k, p, k) for p in passed) / n
        return result
