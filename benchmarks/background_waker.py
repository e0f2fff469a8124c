"""A client-like background load for measuring how the engine's OpenMP steps suffer from another process
waking often: every PERIOD_MS it burns BURN_MS of CPU in a Python loop, for SECONDS.

    python3 benchmarks/background_waker.py 1 0.1 40 &   # ~9% of one core, a wake-up every millisecond
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/serve_workload_offline.py
"""

import sys
import time


def main() -> None:
    period, burn, seconds = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000, float(sys.argv[3])
    end = time.time() + seconds
    while time.time() < end:
        t = time.perf_counter()
        while time.perf_counter() - t < burn:
            pass
        time.sleep(period)


if __name__ == "__main__":
    main()
