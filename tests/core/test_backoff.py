"""kernel_ext._shared.backoff.Backoff: the one retry schedule."""

from __future__ import annotations

import pytest

from kernel_ext._shared.backoff import Backoff
from kernel_ext.errors import ConfigError


def test_waits_double_up_to_the_cap_within_the_jitter_and_reset_starts_over() -> None:
    backoff = Backoff(0.1, 1.0, jitter=0.5)
    nominal = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    for expected in nominal:
        wait = backoff.next()
        assert expected * 0.75 <= wait <= expected * 1.25
    backoff.reset()
    assert backoff.peek() == 0.1


def test_without_jitter_the_waits_are_exact() -> None:
    backoff = Backoff(0.25, 2.0, jitter=0)
    assert [backoff.next() for _ in range(5)] == [0.25, 0.5, 1.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial": 0, "maximum": 1},
        {"initial": 2, "maximum": 1},
        {"initial": 1, "maximum": 2, "factor": 0.5},
        {"initial": 1, "maximum": 2, "jitter": 1.5},
    ],
)
def test_bad_schedules_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Backoff(**kwargs)
