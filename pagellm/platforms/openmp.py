"""OpenMP settings for a process that steps a model next to other busy processes (the engine core of
`pagellm serve`, beside its API process and clients).

libgomp (torch's OpenMP on Linux) spins 300,000 rounds at a barrier before it sleeps: on a Sapphire Rapids
core, whose `pause` takes ~140 cycles, that is ~20 ms. Alone, spinning is what keeps a decode step's few
hundred short parallel regions fast; but when another process spins on the same cores, each side burns its
time slices waiting for a thread that is not running. Measured on the 2-core Xeon VM (benchmarks/NOTES.md,
fifteenth session): 16 requests x 32 tokens took 1.6 s at 300,000 or 10,000 rounds, 2.4 s passive; with a
torch process computing beside it 47 s at 300,000, 5.6 s at 10,000, 2.3 s passive. The serve workload
offline ran ~600 output tok/s at 10,000 and more, 547 at 1,000, 440 passive.
"""

from __future__ import annotations

SPIN_COUNT = 10_000


def bounded_spin_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child process that steps a model, with libgomp's spin-wait bounded to SPIN_COUNT rounds
    unless the user chose a wait policy or spin count."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env
    return dict(env, GOMP_SPINCOUNT=str(SPIN_COUNT))
