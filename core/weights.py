"""Token weights, "quantity x quality" (docs/algorithm.md, "Syncer: one round of fragment p", item 4).

w = tokens^2 / steps = tokens x (tokens per step): a learner that processed more tokens, or larger
batches per step, since it last received the fragment weighs more. No steps means weight 0.
"""

from __future__ import annotations

import math

TOKENS_MAX = 2**62  # counters above this are corrupt, not large


def token_weight(tokens: int, steps: int) -> float:
    """w_{m,p} = tokens^2 / steps, in float64; 0 when steps == 0."""
    if tokens < 0 or steps < 0 or tokens > TOKENS_MAX or steps > TOKENS_MAX:
        raise ValueError(f"token counters must lie in [0, 2^62]: tokens={tokens}, steps={steps}")
    if steps == 0:
        if tokens:
            raise ValueError(f"{tokens} tokens reported over 0 steps")
        return 0.0
    return float(tokens) * (float(tokens) / float(steps))


def normalised(weights: list[float]) -> list[float]:
    """Weights scaled to sum to 1; raises when none is positive (a merge needs at least one)."""
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and non-negative, got {weights}")
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError("no contribution has a positive weight")
    return [w / total for w in weights]
