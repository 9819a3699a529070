"""Seeded arrival generator: Poisson and gamma (burstiness) statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.loadtest.arrivals import arrival_times, intervals

N = 200_000


def test_poisson_gaps_mean_and_variance() -> None:
    gaps = intervals(N, rate=4.0, burstiness=1.0, seed=0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.var() == pytest.approx(0.0625, rel=0.03)  # exponential: var = mean^2


def test_poisson_counts_mean_equals_variance() -> None:
    times = arrival_times(N, rate=4.0, burstiness=1.0, seed=1)
    counts = np.bincount(times.astype(int))[:-1]  # drop the partial last second
    assert counts.mean() == pytest.approx(4.0, rel=0.02)
    assert counts.var() == pytest.approx(4.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_keeps_rate_and_sets_cv(burstiness: float) -> None:
    gaps = intervals(N, rate=10.0, burstiness=burstiness, seed=2)
    assert gaps.mean() == pytest.approx(0.1, rel=0.02)
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.06)


def test_burstier_means_more_variable_counts() -> None:
    def dispersion(b: float) -> float:
        counts = np.bincount(arrival_times(N, 10.0, b, seed=3).astype(int))[:-1]
        return counts.var() / counts.mean()

    assert dispersion(0.25) > 2.0 > dispersion(1.0) > 0.5 > dispersion(4.0)


def test_seeded_and_reproducible() -> None:
    a = arrival_times(100, 5.0, 0.5, seed=7)
    assert np.array_equal(a, arrival_times(100, 5.0, 0.5, seed=7))
    assert not np.array_equal(a, arrival_times(100, 5.0, 0.5, seed=8))
    assert np.all(np.diff(a) >= 0)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert np.array_equal(arrival_times(5, math.inf, 1.0, seed=0), np.zeros(5))
