"""The built-in decoder-only transformer: pre-norm blocks, causal attention, KV cache, value head.

    >>> from flowrl.models import TinyLMSpec, build_model
    >>> policy = build_model(TinyLMSpec(d_model=64, n_layers=2, n_heads=4), seed=0)
    >>> critic = build_model(TinyLMSpec(d_model=64, n_layers=2, n_heads=4), value_head=True, seed=0)

Initialisation is a pure function of ``(spec, seed)`` -- every process that builds the policy from
the same graph gets bitwise the same weights without any transfer -- and the critic's trunk equals
the policy's (heads are initialised last). A policy starts near uniform over the vocabulary.

Padding is never attended to: ``forward`` takes an ``attention_mask`` (True on real tokens) and the
KV cache remembers which of its slots are pads, so a row's outputs do not depend on its pad ids or
on the other rows of its batch. ``forward_packed`` computes sequences of their own length without
any pad: the linear layers run on all tokens at once and attention runs per sequence.
``forward_slots`` serves continuous batching: a :class:`SlotCache` holds one sequence per slot, each
at its own length, and one call extends any subset of the slots (prefill or one decode step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowrl.models.base import CausalLM, default_positions
from flowrl.models.spec import TinyLMSpec


@dataclass
class KVCache:
    """Per-layer key and value buffers ``[B, H, max_len, Dh]``; slots ``< length`` are filled.

    ``key_mask [B, max_len]`` is False on the slots that hold pads (never attended to), and
    ``next_pos [B]`` is the position the next real token of each row takes (its real tokens so far).
    ``padded`` says whether any slot is a pad yet: until then decoding needs no mask at all.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_mask: torch.Tensor
    next_pos: torch.Tensor
    length: int = 0
    padded: bool = False
    max_next_pos: int = 0
    """The largest ``next_pos`` (a Python int, so decoding checks ``max_seq_len`` without a sync)."""


@dataclass
class SlotCache:
    """Per-layer key and value buffers ``[N, H, max_len, Dh]``: slot ``i`` holds one sequence.

    Slots are independent: a row written at position ``p`` of its slot attends to that slot's keys
    ``0..p`` only, so what the other slots hold (a finished sequence's leftovers, a longer
    neighbour, nothing) never matters. Which slots are in use, and how long each sequence is, is the
    caller's bookkeeping (the continuous engine's); the cache is just the memory.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: "_Plan") -> torch.Tensor:
        """Write ``k, v [B, H, S, Dh]`` (row ``b`` at positions ``plan.cols[b]`` of slot
        ``plan.slots[b]``) and return the attention of ``q [B, H, S, Dh]`` over each row's slot."""
        # advanced indices around a slice put their dims first: the target is [B, S, H, Dh]
        self.keys[layer][plan.slots[:, None], :, plan.cols] = k.transpose(1, 2)
        self.values[layer][plan.slots[:, None], :, plan.cols] = v.transpose(1, 2)
        if plan.prefill:  # every row starts at 0: its keys are just these, right-padded, causal
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # attend over the slot window [lo, hi) as a view (gathering the rows' slots would copy
        # the whole cache each step); queries of slots outside the batch are zeros, outputs dropped
        lo, hi = plan.window
        kmax = plan.mask.shape[-1]
        if plan.sparse:  # few rows spread over many slots (a long tail): copying theirs reads less
            keys, values = self.keys[layer][plan.slots, :, :kmax], self.values[layer][plan.slots, :, :kmax]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.mask)
        keys, values = self.keys[layer][lo:hi, :, :kmax], self.values[layer][lo:hi, :, :kmax]
        rows = plan.slots - lo
        if plan.dense:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.mask)
        full = q.new_zeros((hi - lo, *q.shape[1:]))
        full[rows] = q
        return F.scaled_dot_product_attention(full, keys, values, attn_mask=plan.mask)[rows]


@dataclass
class _Plan:
    """How the queries of one pass attend (the same for every layer)."""

    mask: torch.Tensor | None = None
    """Bool ``[S, K]`` or ``[B, 1, S, K]``, True where a query may attend to a key; None = no mask."""
    causal: bool = False
    """SDPA's ``is_causal`` (square attention without a cache)."""
    segments: list[tuple[int, int]] | None = None
    """Packed: token ranges ``[a, b)``, each attending only to itself, causally."""
    groups: "tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor] | None" = None
    """Packed, by length: ``[(length, count)]``, the token order that puts the sequences of each
    length side by side, and its inverse (one batched causal attention per distinct length)."""
    cache: KVCache | None = None
    start: int = 0
    slot_cache: SlotCache | None = None
    """Slots: rows live in ``slot_cache`` (``slots [B]``), the new tokens at positions ``cols [B, S]``;
    ``prefill``: every row starts at 0; else attention runs over the slots ``window = (lo, hi)``
    (``mask [hi - lo, 1, S, K]``), ``dense`` when the rows are exactly those slots in order."""
    slots: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    prefill: bool = False
    window: tuple[int, int] = (0, 0)
    dense: bool = False
    sparse: bool = False
    """Slot decode: the rows are few among the window's slots; attention reads theirs, gathered."""


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, S, Dh]; cos/sin [S, Dh/2] or [B, 1, S, Dh/2]: rotate channel pairs (i, i + Dh/2) by the angle.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def padded_causal_mask(key_mask: torch.Tensor, start: int, s: int) -> torch.Tensor:
    """Bool ``[B, 1, s, start + s]``: query ``i`` (slot ``start + i``) sees the real keys at slots
    ``<= start + i``, and always itself -- so a pad query has one key and no row is ever all masked
    (an all-masked row would give NaN, and a NaN value times a zero weight poisons real queries)."""
    k = start + s
    slots = torch.arange(k, device=key_mask.device)
    query_slots = torch.arange(start, k, device=key_mask.device)[:, None]
    allowed = (slots[None] <= query_slots) & key_mask[:, None, None, :k]
    return allowed | (slots[None] == query_slots)


def length_groups(segments: list[tuple[int, int]], device) -> "tuple[list, torch.Tensor, torch.Tensor]":
    """What `_grouped_attention` needs for packed sequences `segments` (token ranges `[a, b)`)."""
    by_len: dict[int, list[int]] = {}
    for a, e in segments:
        by_len.setdefault(e - a, []).append(a)
    shape, parts = [], []
    for length, starts in by_len.items():
        shape.append((length, len(starts)))
        parts.append((torch.tensor(starts)[:, None] + torch.arange(length)[None]).reshape(-1))
    order = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return shape, order.to(device), inverse.to(device)


def _grouped_attention(q, k, v, shape, order, inverse) -> torch.Tensor:
    """Causal attention of packed sequences ``q, k, v [1, H, N, Dh]``: the sequences of one length
    as one batch (``[count, H, length, Dh]``, SDPA ``is_causal``), none seeing another; the result in
    the packed order. One kernel call per distinct length, never a pad."""
    h, dh = q.shape[1], q.shape[3]
    qs, ks, vs = (t.index_select(2, order)[0] for t in (q, k, v))  # [H, N, Dh], grouped by length
    outs, at = [], 0
    for length, count in shape:
        n = length * count
        part = [t[:, at:at + n].reshape(h, count, length, dh).transpose(0, 1) for t in (qs, ks, vs)]
        o = F.scaled_dot_product_attention(*part, is_causal=True)  # [count, H, length, Dh]
        outs.append(o.transpose(0, 1).reshape(h, n, dh))
        at += n
    return torch.cat(outs, dim=1)[None].index_select(2, inverse) if outs else q


class _Attention(nn.Module):
    def __init__(self, spec: TinyLMSpec) -> None:
        super().__init__()
        self.n_heads = spec.n_heads
        self.head_dim = spec.d_model // spec.n_heads
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)

    def forward(self, x, rope, plan: _Plan, layer: int) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if rope is not None:  # q, k [B, H, S, Dh]
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        cache = plan.cache
        if cache is not None:
            start = plan.start
            cache.keys[layer][:, :, start : start + s] = k
            cache.values[layer][:, :, start : start + s] = v
            k = cache.keys[layer][:, :, : start + s]
            v = cache.values[layer][:, :, : start + s]
        if plan.slot_cache is not None:
            out = plan.slot_cache.attend(layer, q, k, v, plan)
        elif plan.groups is not None:  # packed: each sequence on its own, causal, batched by length
            out = _grouped_attention(q, k, v, *plan.groups)
        elif plan.segments is not None:  # packed, lengths mostly distinct: one call per sequence
            parts = [F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], is_causal=True)
                     for a, e in plan.segments]
            out = torch.cat(parts, dim=2) if parts else q
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, is_causal=plan.causal)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class _Block(nn.Module):
    def __init__(self, spec: TinyLMSpec) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.d_model)
        self.attn = _Attention(spec)
        self.ln2 = nn.LayerNorm(spec.d_model)
        self.fc = nn.Linear(spec.d_model, spec.mlp_ratio * spec.d_model)
        self.proj = nn.Linear(spec.mlp_ratio * spec.d_model, spec.d_model)

    def forward(self, x, rope, plan: _Plan, layer: int) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope, plan, layer)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyLM(CausalLM):
    """A policy (``lm_head``) or, with ``value_head=True``, a critic (one value per token)."""

    def __init__(self, spec: TinyLMSpec, *, value_head: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.vocab_size = spec.vocab_size
        self.has_value_head = value_head
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_emb = nn.Embedding(spec.max_seq_len, spec.d_model) if spec.positions == "learned" else None
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.n_layers))
        self.norm = nn.LayerNorm(spec.d_model)
        if value_head:
            self.value_head = nn.Linear(spec.d_model, 1)
        else:
            self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
            if spec.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight
        if spec.positions == "rope":
            half = spec.d_model // spec.n_heads // 2
            inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
            angles = torch.arange(spec.max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None]
            self.register_buffer("rope_cos", angles.cos(), persistent=False)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        std = self.spec.init_std
        heads = {"lm_head.weight", "value_head.weight", "value_head.bias"}
        for name, p in self.named_parameters():  # trunk first, in a fixed order; heads below
            if name in heads:
                continue
            if name.endswith(".bias") or ".ln" in name or name.startswith("norm."):
                p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
            elif name.endswith("proj.weight"):  # residual outputs: keep the stream's variance flat
                p.normal_(0.0, std / math.sqrt(2 * self.spec.n_layers), generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)
        if self.has_value_head:
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()
        elif not self.spec.tie_embeddings:
            self.lm_head.weight.normal_(0.0, std, generator=gen)

    # ------------------------------------------------------------------------------- internals
    def _check_positions(self, end: int) -> None:
        """Refuse positions ``>= max_seq_len`` (``end`` = the largest position + 1)."""
        if end > self.spec.max_seq_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds max_seq_len={self.spec.max_seq_len}; "
                "raise model.max_seq_len or shorten prompts / max_new_tokens"
            )

    def _trunk(self, tokens: torch.Tensor, positions: "int | torch.Tensor", plan: _Plan) -> torch.Tensor:
        """Hidden states ``[B, S, D]``; ``positions`` is the first position of every row (an int) or
        one position per token (``[B, S]``)."""
        x = self.tok_emb(tokens)
        rope = None
        if isinstance(positions, int):
            span = slice(positions, positions + tokens.shape[1])
            if self.pos_emb is not None:
                x = x + self.pos_emb.weight[span]
            else:
                rope = (self.rope_cos[span], self.rope_sin[span])
        elif self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        else:
            rope = (self.rope_cos[positions][:, None], self.rope_sin[positions][:, None])
        for i, block in enumerate(self.blocks):
            x = block(x, rope, plan, i)
        return self.norm(x)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.has_value_head:
            return self.value_head(h).squeeze(-1)
        return self.lm_head(h)

    # ------------------------------------------------------------------------------- interface
    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, L, V]`` or values ``[B, L]``; with ``attention_mask`` (True = real token) no
        query attends to a pad, and positions default to the count of real tokens before each one."""
        b, l = tokens.shape
        if attention_mask is None and position_ids is None:
            self._check_positions(l)
            return self._head(self._trunk(tokens, 0, _Plan(causal=True)))
        plan = _Plan(causal=True)
        if attention_mask is not None:
            attention_mask = attention_mask.to(device=tokens.device, dtype=torch.bool)
            plan = _Plan(mask=padded_causal_mask(attention_mask, 0, l))
            if position_ids is None:
                position_ids = default_positions(attention_mask)
        position_ids = position_ids.to(tokens.device)
        self._check_positions(int(position_ids.max()) + 1 if position_ids.numel() else 0)
        return self._head(self._trunk(tokens, position_ids, plan))

    def forward_packed(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Outputs ``[N, V]`` (values ``[N]``) of packed sequences, no pad computed: the linear
        layers run on all ``N`` tokens at once, attention runs causally within each sequence."""
        bounds = cu_seqlens.to(torch.int64).cpu()
        lens = bounds[1:] - bounds[:-1]
        self._check_positions(int(lens.max()) if len(lens) else 0)
        positions = torch.arange(tokens.shape[0]) - torch.repeat_interleave(bounds[:-1], lens)
        segments = [(a, e) for a, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()) if e > a]
        # many sequences of few lengths (short tasks): one batched call per length; else one per sequence
        few = len({e - a for a, e in segments}) * 2 <= len(segments)
        plan = _Plan(segments=segments, groups=length_groups(segments, tokens.device) if few else None)
        h = self._trunk(tokens[None], positions[None].to(tokens.device), plan)
        return self._head(h[0])

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache of ``max_len`` slots; refused beyond ``max_seq_len`` so that a generation
        too long for the model fails at once, not at whichever step a row first gets there."""
        self._check_positions(max_len)
        p = self.tok_emb.weight
        shape = (batch, self.spec.n_heads, max_len, self.spec.d_model // self.spec.n_heads)
        n = self.spec.n_layers
        return KVCache(
            keys=[torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(n)],
            values=[torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(n)],
            key_mask=torch.ones(batch, max_len, dtype=torch.bool, device=p.device),
            next_pos=torch.zeros(batch, dtype=torch.int64, device=p.device),
        )

    def forward_cached(self, tokens: torch.Tensor, cache: KVCache, start: int,
                       attention_mask: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, S, V]`` of tokens in cache slots ``start..start+S-1``; extends ``cache``.

        ``attention_mask [B, S]`` marks pads among the new tokens (left-padded prompts); later
        calls never attend to them. Positions default to each row's count of real tokens so far."""
        if self.has_value_head:
            raise TypeError("forward_cached samples tokens; a value-head model (critic) has no logits")
        if start != cache.length:
            raise ValueError(f"cache holds {cache.length} positions but start={start}; feed tokens in order")
        b, s = tokens.shape
        if attention_mask is not None:
            attention_mask = attention_mask.to(device=tokens.device, dtype=torch.bool)
            steps, added = default_positions(attention_mask), attention_mask.to(torch.int64).sum(dim=1)
            padded = cache.padded or not bool(attention_mask.all())
        else:
            steps, added, padded = torch.arange(s, device=tokens.device), s, cache.padded
        if attention_mask is None and position_ids is None and not cache.padded:
            self._check_positions(start + s)
            positions: int | torch.Tensor = start  # no pad anywhere: every row's positions are its slots
        else:
            positions = cache.next_pos[:, None] + steps if position_ids is None else position_ids.to(tokens.device)
            exact = attention_mask is not None or position_ids is not None  # else: all rows advance by s
            self._check_positions(int(positions.max()) + 1 if exact else cache.max_next_pos + s)
        # checks passed: record the new slots
        if attention_mask is not None:
            cache.key_mask[:, start : start + s] = attention_mask
        cache.padded = padded
        cache.next_pos += added
        cache.max_next_pos = int(cache.next_pos.max()) if attention_mask is not None and b else cache.max_next_pos + s
        if padded:
            mask = padded_causal_mask(cache.key_mask, start, s)
        else:  # one new token sees every slot, a chunk sees the slots up to its own
            slots = torch.arange(start + s, device=tokens.device)
            mask = None if s == 1 else slots[None] <= slots[start:, None]
        plan = _Plan(mask=mask, cache=cache, start=start)
        h = self._trunk(tokens, positions, plan)
        cache.length = start + s
        return self.lm_head(h)

    def new_slot_cache(self, num_slots: int, max_len: int | None = None) -> SlotCache:
        """Empty key/value memory for ``num_slots`` sequences of up to ``max_len`` tokens each
        (default ``max_seq_len``)."""
        max_len = self.spec.max_seq_len if max_len is None else max_len
        self._check_positions(max_len)
        p = self.tok_emb.weight
        shape = (num_slots, self.spec.n_heads, max_len, self.spec.d_model // self.spec.n_heads)
        n = self.spec.n_layers
        return SlotCache(keys=[torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(n)],
                         values=[torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(n)])

    def forward_slots(self, tokens: torch.Tensor, cache: SlotCache, slots: torch.Tensor, starts: torch.Tensor,
                      last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens [B, S]``, row ``b`` at positions ``starts[b] ..`` of slot ``slots[b]``.

        Each row attends to its own slot's keys up to each query's position, so rows of different
        lengths share the call with no mask of pads: a decode step is ``S = 1`` with each row at
        its own length; a prefill is ``starts = 0`` with prompts right-padded (a pad comes after
        every real token of its row, so no real query sees it; its keys land past the row's length,
        where the next real token overwrites them). Returns ``[B, S, V]``, or ``[B, V]`` at
        column ``last[b]`` of each row when ``last`` is given (a prefill's last real token)."""
        if self.has_value_head:
            raise TypeError("forward_slots samples tokens; a value-head model (critic) has no logits")
        b, s = tokens.shape
        device = tokens.device
        starts = starts.to(device=device, dtype=torch.int64)
        cols = starts[:, None] + torch.arange(s, device=device)  # [B, S] each token's position
        kmax = int(cols.max()) + 1 if b else 1
        if kmax > cache.max_len:
            raise ValueError(f"a sequence reaches position {kmax - 1}, beyond the slot length {cache.max_len}; "
                             "raise the cache's max_len or shorten prompts / max_new_tokens")
        self._check_positions(kmax)
        slots = slots.to(device=device, dtype=torch.int64)
        h = self._trunk(tokens, cols, self._slot_plan(cache, slots, starts, cols, kmax))
        if last is not None:
            h = h[torch.arange(b, device=device), last.to(device)]
        return self.lm_head(h)

    @staticmethod
    def _slot_plan(cache: SlotCache, slots: torch.Tensor, starts: torch.Tensor, cols: torch.Tensor,
                   kmax: int) -> _Plan:
        """How ``forward_slots`` attends (the same for every layer)."""
        plan = _Plan(slot_cache=cache, slots=slots, cols=cols)
        b, s = cols.shape
        if not bool(starts.any()):
            plan.prefill = True
            return plan
        lo, hi = int(slots.min()), int(slots.max()) + 1
        plan.window = (lo, hi)
        plan.dense = hi - lo == b and bool((slots == torch.arange(lo, hi, device=slots.device)).all())
        causal = torch.arange(kmax, device=cols.device)[None, None] <= cols[:, :, None]  # [B, S, kmax]
        plan.sparse = 4 * b <= hi - lo  # the window would be mostly other slots: gather the rows' own
        if plan.sparse:
            plan.mask = causal[:, None]
            return plan
        # a slot outside the batch sees its key 0 only (a row with no key at all would give NaN)
        mask = torch.zeros(hi - lo, s, kmax, dtype=torch.bool, device=cols.device)
        mask[:, :, 0] = True
        mask[slots - lo] = causal
        plan.mask = mask[:, None]
        return plan
