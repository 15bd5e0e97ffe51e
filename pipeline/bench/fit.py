"""Where speculation stops paying: the crossover of always-on and off throughput over concurrency. Pure.

The ratio on/off is read at each measured concurrency; the crossover is where it falls through 1,
interpolated on log2(concurrency) between the last level where speculation paid and the first where it
didn't (concurrency grows in powers of two, and so does the cost of a step past the memory-bound region).
The gate's ceiling is then the largest whole batch at or below the crossover.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Crossover:
    concurrency: float | None  # where on/off crosses 1; None when it never does in the range
    pays_everywhere: bool  # on >= off at every level measured
    pays_nowhere: bool  # on < off at every level measured

    @property
    def threshold(self) -> int:
        """The gate's --gate-batch-size: 0 when speculation never paid, and for `pays_everywhere` the
        caller's largest level (the crossover is past what was measured)."""
        if self.pays_nowhere or self.concurrency is None:
            return 0
        return max(1, math.floor(self.concurrency + 1e-9))


def crossover(levels: list[int], off: list[float], on: list[float]) -> Crossover:
    """levels ascending; off[i], on[i]: tokens/s at levels[i] with speculation off and always on."""
    if not (len(levels) == len(off) == len(on)) or not levels:
        raise ValueError("levels, off and on must be the same non-empty length")
    ratios = [b / a if a > 0 else math.inf for a, b in zip(off, on)]
    pays = [r >= 1.0 for r in ratios]
    if all(pays):
        return Crossover(float(levels[-1]), True, False)
    if not any(pays):
        return Crossover(None, False, True)
    first_loss = pays.index(False)
    if first_loss == 0:  # lost at the smallest level and paid somewhere above (noise): no ceiling that holds
        return Crossover(None, False, False)
    i = first_loss
    x0, x1 = math.log2(levels[i - 1]), math.log2(levels[i])
    y0, y1 = ratios[i - 1] - 1.0, ratios[i] - 1.0
    x = x0 + (x1 - x0) * (y0 / (y0 - y1)) if y0 != y1 else x0
    return Crossover(2.0 ** x, False, False)
