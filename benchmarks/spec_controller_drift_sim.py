"""The speculation controller (pagellm/spec_decode/adaptive.py) on a simulated machine whose speed drifts, against
plain decoding on the same machine: the speed-up it reaches, and how often it loses.

Every run decodes a batch of requests to a fixed length twice on the same simulated clock, once with the
controller deciding which drafts to verify and once with none. A step of R rows takes COSTS_MS(R) (the step costs
the Zen 4 VM's controller measured at batch 4 in the fortieth session, past 20 rows +0.75 ms a row) times the
machine's speed at that moment: a slow AR(1) wander, steps that take 1.5-3x (1 in 50), and the cost of attention
growing with the context (+17% over 300 tokens). benchmarks/step_time_noise.py measures that noise on a machine
(the forty-second session's figures are in benchmarks/NOTES.md). The model slows every step of a moment alike and
takes the context as a common factor, which is the controller's own model: a machine where they are not would
read worse. A request alternates between copying (a draft is right 95% of the time) and writing (10%), the n-gram
proposer offering drafts while it copies and for 30% of its writing steps; this mimics the grounded task, where
~70% of drafts are accepted.

    .venv/bin/python benchmarks/spec_controller_drift_sim.py [RUNS [ADAPTIVE_PY [MIN_GAIN]]]   # seconds

ADAPTIVE_PY: another version of the controller's file (`git show 2d97a7e~1:pagellm/spec_decode/adaptive.py`, the
one before the speed factor, gives the forty-second session's "before"); MIN_GAIN: that module's MIN_GAIN instead
of its own (the session compared 0.05 / 0.1 / 0.15 / 0.2).
"""

import importlib.util
import math
import random
import statistics
import sys

from pagellm.spec_decode import adaptive

COSTS_MS = {1: 5.28, 4: 6.5, 5: 7.6, 8: 10.4, 12: 14.3, 20: 22.3}
K = 4
TOKENS = 200


def true_cost_ms(rows: int) -> float:
    if rows in COSTS_MS:
        return COSTS_MS[rows]
    if rows > 20:
        return COSTS_MS[20] + 0.75 * (rows - 20)
    lo = max(r for r in COSTS_MS if r < rows)
    hi = min(r for r in COSTS_MS if r > rows)
    return COSTS_MS[lo] + (rows - lo) / (hi - lo) * (COSTS_MS[hi] - COSTS_MS[lo])


class Machine:
    """The speed factor at simulated time t (ms): the same realisation for both engines of a run."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.log_speed = [0.0]  # on a 5 ms grid

    def speed(self, t_ms: float) -> float:
        i = int(t_ms // 5)
        while len(self.log_speed) <= i:
            self.log_speed.append(0.97 * self.log_speed[-1] + self.rng.gauss(0, 0.03))
        return math.exp(self.log_speed[i])


def decode(machine: Machine, batch: int, ctl, seed: int) -> float:
    """Simulated ms to generate TOKENS tokens for each of `batch` requests; ctl None: plain decoding."""
    rng = random.Random(seed)  # the requests' copying runs and the steps' own noise
    done = dict.fromkeys(range(batch), 0)
    copying = {r: rng.random() < 0.5 for r in done}
    t = 0.0
    while done:
        ids = list(done)
        proposals = {str(r): K for r in ids if copying[r] or rng.random() < 0.3}
        keep = {}
        if ctl is not None:
            if ctl.wants_proposals(len(ids)):
                keep = ctl.plan(proposals, batch_rows=len(ids))
            else:
                ctl.skip()
        rows = len(ids) + sum(keep.values())
        context = 1 + 0.17 * statistics.mean(done.values()) / 300
        spike = rng.uniform(1.5, 3.0) if rng.random() < 0.02 else 1.0
        dt = true_cost_ms(rows) * machine.speed(t) * context * spike * math.exp(rng.gauss(0, 0.03))
        if ctl is not None:
            ctl.observe_step(rows, dt / 1000)
        for r in ids:
            kept = keep.get(str(r), 0)
            p = 0.95 if copying[r] else 0.1
            accepted = 0
            while accepted < kept and rng.random() < p:
                accepted += 1
            if kept and ctl is not None:
                ctl.observe_request(str(r), kept, accepted)
            for _ in range(1 + accepted):
                if rng.random() < 0.04:  # a copying run ends, or a new one starts
                    copying[r] = not copying[r]
            done[r] += 1 + accepted
            if done[r] >= TOKENS:
                del done[r]
        if ctl is not None:
            ctl.retain({str(r) for r in done})
        t += dt
    return t


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    module = adaptive
    if len(sys.argv) > 2:
        spec = importlib.util.spec_from_file_location("other_adaptive", sys.argv[2])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if len(sys.argv) > 3:
        module.MIN_GAIN = float(sys.argv[3])
    for batch in (1, 4, 16):
        ratios = []
        for seed in range(runs):
            plain = decode(Machine(seed), batch, None, seed)
            spec = decode(Machine(seed), batch, module.SpeculationController(), seed)
            ratios.append(plain / spec)
        q = statistics.quantiles(ratios, n=20)
        print(f"batch {batch:2d}: speed-up median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}, "
              f"5th percentile {q[0]:.3f}, runs below 0.97 {sum(r < 0.97 for r in ratios)} of {runs}")


if __name__ == "__main__":
    main()
