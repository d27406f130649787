"""pass@k, the unbiased estimator of Chen et al. (2021, "Evaluating LLMs trained on code").

    >>> pass_at_k(n=4, c=1, k=1), pass_at_k(n=4, c=1, k=4), pass_at_k(n=4, c=0, k=2)
    (0.25, 1.0, 0.0)

With ``n`` samples of which ``c`` pass, the chance that ``k`` of them drawn without replacement
contain at least one pass: ``1 - C(n - c, k) / C(n, k)``.
"""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)
