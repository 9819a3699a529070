"""Request arrival times: a gamma renewal process, Poisson at burstiness 1 (vLLM's model).

Inter-arrival gaps are Gamma(shape=b, scale=1/(rate*b)): the mean gap is always 1/rate and
the squared coefficient of variation is 1/b, so b < 1 is burstier than Poisson and b > 1
is more regular. An infinite rate sends every request at t=0.
"""

from __future__ import annotations

import math

import numpy as np


def intervals(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """`n` gaps in seconds; the first request also waits one gap, as in vLLM."""
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng([seed, 1])  # own stream: independent of the dataset's draws
    theta = 1.0 / (rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=n)


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Offsets from the run's start at which each request is sent."""
    return np.cumsum(intervals(n, rate, burstiness, seed))
