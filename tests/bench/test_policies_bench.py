"""The arithmetic of `chunkline bench policies`: robots one lane serves within a deadline."""

from chunkline.bench.policies_bench import robots_served


def test_batching_serves_more_where_the_curve_is_flat() -> None:
    single, batching, size = robots_served({1: 0.015, 2: 0.015, 4: 0.026, 8: 0.055, 16: 0.093}, deadline_s=0.1, period_s=0.5)
    assert (single, batching, size) == (33, 80, 16)


def test_batching_buys_nothing_where_time_grows_with_the_batch() -> None:
    assert robots_served({1: 0.01, 2: 0.02, 4: 0.04, 8: 0.08}, deadline_s=0.1, period_s=0.5) == (50, 50, 1)


def test_nothing_served_when_batch_one_misses_the_deadline() -> None:
    assert robots_served({1: 0.2, 2: 0.3}, deadline_s=0.1, period_s=0.5) == (0, 0, 0)
