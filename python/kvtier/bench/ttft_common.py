"""What the TTFT benchmark's modules share: the arms, the unit and the logging.

``kvtier.bench.ttft`` re-exports every name here.
"""

from __future__ import annotations

import statistics
import sys

ALL_ARMS = ("recompute", "gpu", "l1", "l1-serial", "server", "file", "save")
GiB = 1 << 30


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
