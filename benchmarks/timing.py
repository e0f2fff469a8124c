"""The microbenchmarks' clock: median milliseconds of a callable over a few runs."""

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
