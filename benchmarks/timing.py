"""The microbenchmarks' clocks: median milliseconds of a callable over a few runs, or the best round's mean."""

import statistics
import time


def median_ms(fn, reps: int = 7, warmup: int = 0) -> float:
    """fn() `warmup` times untimed, then the median of `reps` timed calls, in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def best_ms(fn, calls: int, rounds: int, warmup: int = 0) -> float:
    """fn() `warmup` times untimed, then `rounds` rounds of `calls` calls: the fastest round's mean, in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return min(times)
