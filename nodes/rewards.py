"""Rewards from configuration: decode each response, score it with a list of weighted terms.

    rewards:
      kind: rewards
      config:
        terms:
          - {type: math, weight: 1.0}
          - {type: format, weight: 0.1, pattern: '\\d+'}
          - {type: length, weight: 0.5, buffer: 2}

Takes the batch a rollout made from a `dataset` source: responses are decoded with the tokenizer
named in the batch meta (`tokenizer`), reference answers come from `targets` (UTF-8 bytes, see
flowrl.data.answers). Adds `scores [B] float32` (sum of weight x term) and reports
`reward_<term>_mean` per term. Stateless: the same batch always gets the same scores.
"""

from pydantic import Field

import flowrl
from flowrl.rewards.terms import TermSpec


class Rewards(flowrl.Node):
    role = "reward"

    class Config(flowrl.NodeConfig):
        terms: list[TermSpec] = Field(min_length=1)
        """Weighted reward terms (`type: math | format | length | code`); see flowrl.rewards.terms."""

    async def setup(self):
        from flowrl.rewards.terms import term_names

        self.names = term_names(self.config.terms)

    async def process(self, batch, port):
        import anyio
        import torch

        from flowrl.data import ENCODING, decode_answers, tokenizer_for
        from flowrl.rewards.terms import Inputs, score_terms

        meta = batch.meta
        if meta.get("targets_encoding") != ENCODING or "tokenizer" not in meta:
            raise ValueError("the `rewards` node needs batches from a `dataset` source (targets as UTF-8 answers, "
                             "meta `tokenizer`); for the built-in digit tasks use `kind: reward`")
        from flowrl.nodes.common import Sequences

        tok = tokenizer_for(meta["tokenizer"])
        responses, lengths = Sequences.of(batch, f"node `{self.ctx.name}`").responses(tok.pad_id)
        lengths = lengths.tolist()
        x = Inputs(responses=[tok.decode(r[:n].tolist()) for r, n in zip(responses, lengths)],
                   references=decode_answers(batch.tensors["targets"]), lengths=[int(n) for n in lengths],
                   max_tokens=int(meta.get("max_new_tokens") or max(lengths, default=1)))
        # code terms wait on subprocesses: off the event loop, so heartbeats keep flowing
        per, total = await anyio.to_thread.run_sync(score_terms, self.config.terms, x)
        rec = self.ctx.recorder
        for name, values in per.items():
            rec.mean(f"reward_{name}", sum(values) / len(values), weight=len(values))
        scores = torch.tensor(total, dtype=torch.float32)
        rec.mean("score", float(scores.mean()), weight=len(scores), per_node=True)
        return batch.replace(tensors={**batch.tensors, "scores": scores})
