"""Plain-Python reference implementations (loops over lists) the tensor functions are checked against."""

from __future__ import annotations

import math


def valid(row_mask):
    return [t for t, m in enumerate(row_mask) if m]


def masked_mean(x, mask):
    vals = [v for xr, mr in zip(x, mask) for v, m in zip(xr, mr) if m]
    return sum(vals) / len(vals)


def masked_var(x, mask):
    vals = [v for xr, mr in zip(x, mask) for v, m in zip(xr, mr) if m]
    mu = sum(vals) / len(vals)
    return sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)


def gae(rewards, values, mask, gamma, lam):
    advs, rets = [], []
    for r, v, m in zip(rewards, values, mask):
        idx = valid(m)
        adv_row, ret_row = [0.0] * len(r), [0.0] * len(r)
        running = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = values_at(v, idx, k + 1)
            delta = r[t] + gamma * next_v - v[t]
            running = delta + gamma * lam * running
            adv_row[t] = running
            ret_row[t] = running + v[t]
        advs.append(adv_row)
        rets.append(ret_row)
    return advs, rets


def values_at(v, idx, k):
    return v[idx[k]] if k < len(idx) else 0.0


def group_advantages(scores, group_size, normalize_std=True, eps=1e-6):
    out = []
    for g in range(0, len(scores), group_size):
        grp = scores[g : g + group_size]
        mu = sum(grp) / len(grp)
        sd = math.sqrt(sum((s - mu) ** 2 for s in grp) / (len(grp) - 1))
        out += [(s - mu) / (sd + eps) if normalize_std else s - mu for s in grp]
    return out


def ppo_token_loss(lp, old, adv, clip_low, clip_high):
    ratio = math.exp(lp - old)
    clipped_ratio = min(max(ratio, 1 - clip_low), 1 + clip_high)
    return max(-adv * ratio, -adv * clipped_ratio), (-adv * clipped_ratio) > (-adv * ratio)


def kl(lp, ref, kind):
    log_r = ref - lp
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1 - log_r}[kind]


def rollout_is_token(old, rollout, mode, cap, floor=None):
    """(weight, kept) of one token: TIS truncates the ratio at cap, masked IS drops it outside [floor, cap]."""
    rho = math.exp(old - rollout)
    if mode == "truncate":
        return min(rho, cap), True
    if mode == "mask":
        low = 1 / cap if floor is None else floor
        return 1.0, low <= rho <= cap
    return 1.0, True


def ppo_is_loss(lp, old, rollout, adv, mask, clip_low, clip_high, mode, cap, floor=None):
    """token_mean of the clipped PPO loss times each token's IS weight, over the kept valid tokens."""
    total, n = 0.0, 0
    for lr, orr, rr, ar, mr in zip(lp, old, rollout, adv, mask):
        for a, o, r, adv_t, m in zip(lr, orr, rr, ar, mr):
            if not m:
                continue
            w, kept = rollout_is_token(o, r, mode, cap, floor)
            if not kept:
                continue
            loss, _ = ppo_token_loss(a, o, adv_t, clip_low, clip_high)
            total += w * loss
            n += 1
    return total / max(n, 1)


def mismatch(trainer, rollout, mask):
    diffs = [abs(a - b) for tr, rr, mr in zip(trainer, rollout, mask) for a, b, m in zip(tr, rr, mr) if m]
    kls = [math.exp(a - b) - 1 - (a - b)
           for tr, rr, mr in zip(trainer, rollout, mask) for a, b, m in zip(tr, rr, mr) if m]
    return sum(diffs) / len(diffs), max(diffs), sum(kls) / len(kls)
