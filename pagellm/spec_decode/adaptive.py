"""Draft only where it pays: the engine measures what verification rows cost and what drafts bring.

A decode step of R rows (each running request's next token plus its drafts) takes t(R) seconds; a
request yields 1 + P(draft 1 accepted) + P(drafts 1-2 accepted) + ... tokens from k drafts (accepting
stops at the first rejection). So the j-th draft adds P(drafts 1..j accepted) expected tokens at the cost
of one more row, t(R + 1) - t(R). With the drafts sorted by value, the engine keeps the prefix with the
most expected tokens per second (none, unless one beats the plain step by MIN_GAIN) and drops the rest before the
step is scheduled. While a batch size keeps nothing, the proposer itself is skipped on most steps (its
search costs time too). Greedy output is unaffected: drafts never change what is generated, only how
many tokens a step verifies.

Both sides are measured online. t(R) is the machine's speed now times the shape of the cost curve at R rows,
both from whole decode-only steps (row counts never seen are interpolated, or extrapolated from the per-row
slope seen so far). The speed follows what moves every step alike, a shared machine's minute or the context
growing, so a row count measured a while ago is compared with one measured now at the same speed. One moving
average per row count did not: on the Zen 4 VM a plain 4-row step measured in a slow moment read 9.1 ms
against 6.6 later, and a run that kept drafts against it read 0.86x (benchmarks/spec_controller_state.py 4 4).
(benchmarks/spec_controller_drift_sim.py simulates that machine's noise; there the median speed-up at batch 4
went from 0.971x to 0.995x.) A step
beyond OUTLIER times its estimate counts as OUTLIER times: one step in 50 takes 1.5-3x there. Acceptance is
measured per request and draft position: the smoothed rate at which a draft is accepted where the ones before
it were.

A batch size's first step runs plain and its next one with every draft (so both ends are measured);
after that, one step in EXPLORE_EVERY drafts everything proposed and another drafts nothing, so the
estimates follow the text and the context length. That bounds the cost of a wrong estimate to about one
step in EXPLORE_EVERY. Where an exploration finds that drafts still do not pay at its batch size, that
batch size explores half as often (down to one plan in MAX_EXPLORE_EVERY), with one draft per request
instead of all, and back at EXPLORE_EVERY once drafts pay again: an all-drafts step can cost several plain
ones (on the Xeon VM a 20-row verification step of 4 requests costs ~3 plain 4-row steps, and exploring
every 16th step alone lost 6% at batch 4; with the back-off and all drafts still ~4%).
"""

from __future__ import annotations

import collections
import math

# (accepted, offered) pseudo-counts for the first draft position and the later ones: a new request starts at
# 0.5 for its first draft and 2/3 for each next one given the one before was accepted (n-gram acceptance
# comes in runs: once a copy is under way, the next draft is likelier to be right).
FIRST_PRIOR = (1.0, 2.0)
NEXT_PRIOR = (2.0, 3.0)
DECAY = 0.9  # per observation: a request's acceptance follows the text it is writing now
SPEED_EMA = 0.3  # weight of a step's (log) time in the machine's speed factor
# A row count's shape is the mean of what the speed left of its compared steps' (log) times, the later ones
# weighted at least SHAPE_GAIN: a mean settles where a fixed weight would wander (the split into speed and shape
# is free up to a common factor, so a shape that moved with every step's noise took every row count not measured
# since along: x0.6-x1.5 after 3 simulated minutes, a review's probe).
SHAPE_GAIN = 0.02
OUTLIER = 1.5  # a step beyond this factor of its estimate (either way) counts as this factor
COMPARED_WITHIN = 4  # a row count's shape moves only where another row count was measured in this many steps
EXPLORE_EVERY = 16
MAX_EXPLORE_EVERY = 128
RECHECK_EVERY = 4  # while a batch size keeps no drafts, ask the proposer on one step in this many
# A plan with drafts must promise this much more tokens per second than the plain step. The estimates err
# both ways (a step's time wobbles by several percent on a shared machine; the drafts kept are those whose
# acceptance estimates came out highest), but the errors do not cost the same: a plan kept wrongly loses
# time, one dropped wrongly only forgoes a gain that was too small to measure. Where verification rows cost
# nearly a plain row each (a 2-core Zen 4 VM: one decode step's products 5.58 ms at 4 rows, 9.68 at 8,
# benchmarks/microbench_int8_tiles.py), plans near break-even were kept at batch 4 and measured 0.93-0.99x
# (benchmarks/results/zen4/s20_spec_auto_ngram_grounded*). In the drift simulation
# (benchmarks/spec_controller_drift_sim.py 200 pagellm/spec_decode/adaptive.py M, M = 0.05 / 0.1 / 0.15 / 0.2)
# 0.15 lost least at batch 4 and 16 and kept batch 1's gain.
MIN_GAIN = 0.15


class SpeculationController:
    def __init__(self, explore_every: int = EXPLORE_EVERY):
        self.explore_every = explore_every
        # rows -> the cost curve's shape (decode-only steps; seconds at the speed of the first step measured,
        # times a common factor), which decides: only ratios of costs enter a plan
        self.step_cost: dict[int, float] = {}
        self.step_count: dict[int, int] = {}  # rows -> its first step and compared steps, measured
        self.speed = 1.0  # the machine's speed now against the shape: what time and context do to every step
        self.recent_rows: collections.deque[int] = collections.deque(maxlen=COMPARED_WITHIN)
        # request id -> per draft position j: (accepted, offered) counts, decayed; position j is offered when
        # drafts 1..j-1 were accepted
        self.acceptance: dict[str, list[list[float]]] = {}
        self.num_plans = 0
        self.kept: dict[int, int] = {}  # batch rows -> drafts kept by the last plan at that batch size
        self.every: dict[int, int] = {}  # batch rows -> its exploration period (backs off while drafts lose)

    # ---- measurements -------------------------------------------------------------------------
    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step (every request computed its next token, plus drafts) of `rows` rows. Its time
        divides into the machine's speed now, common to every row count, and the row count's shape: what one
        step measures moves the speed first, and the shape only by what the speed does not explain."""
        if not 0 < seconds < math.inf:  # (a clock that did not move, or NaN: nothing measured)
            return
        shape = self.step_cost.get(rows)
        compared = any(r != rows for r in self.recent_rows)  # the speed now rests on other row counts too
        self.recent_rows.append(rows)
        if shape is None:
            self.step_cost[rows] = seconds / self.speed
            self.step_count[rows] = 1
            return
        ratio = min(max(seconds / (shape * self.speed), 1 / OUTLIER), OUTLIER)
        self.speed *= ratio ** SPEED_EMA
        if compared:  # (steps of one row count alone say nothing of the shape: a slow minute is the speed)
            n = self.step_count[rows] = self.step_count[rows] + 1
            self.step_cost[rows] = shape * (ratio ** (1 - SPEED_EMA)) ** max(1 / n, SHAPE_GAIN)

    def observe_request(self, request_id: str, drafted: int, accepted: int) -> None:
        counts = self.acceptance.setdefault(request_id, [])
        for j in range(min(accepted + 1, drafted)):  # positions 1..accepted+1 were offered
            if j == len(counts):
                counts.append(list(FIRST_PRIOR if j == 0 else NEXT_PRIOR))
            counts[j][0] = DECAY * counts[j][0] + (j < accepted)
            counts[j][1] = DECAY * counts[j][1] + 1

    def retain(self, request_ids: set[str]) -> None:
        """Drop the acceptance of requests that no longer run (finished, aborted or preempted)."""
        for rid in [r for r in self.acceptance if r not in request_ids]:
            del self.acceptance[rid]

    def accept_rate(self, request_id: str, position: int = 1) -> float:
        """P(draft `position` is accepted | the drafts before it were)."""
        counts = self.acceptance.get(request_id, [])
        a, d = counts[position - 1] if position <= len(counts) else (FIRST_PRIOR if position == 1 else NEXT_PRIOR)
        return min(a / d, 0.99)

    def draft_values(self, request_id: str, k: int) -> list[float]:
        """Expected tokens the j-th draft adds, j = 1..k: the chance that drafts 1..j are all accepted."""
        values, p = [], 1.0
        for j in range(1, k + 1):
            p *= self.accept_rate(request_id, j)
            values.append(p)
        return values

    def cost(self, rows: int) -> float | None:
        """Estimated seconds for a decode step of `rows` rows now; None before any step was measured."""
        shape = self._shape(rows)
        return None if shape is None else shape * self.speed

    def _shape(self, rows: int) -> float | None:
        known = self.step_cost
        if rows in known:
            return known[rows]
        if not known:
            return None
        below = max((r for r in known if r < rows), default=None)
        above = min((r for r in known if r > rows), default=None)
        if below is not None and above is not None:  # interpolate
            f = (rows - below) / (above - below)
            return known[below] + f * (known[above] - known[below])
        slope = self._slope()
        if below is not None:
            return known[below] + (rows - below) * slope if slope is not None else None
        return max(known[above] - (above - rows) * (slope or 0.0), 1e-9)

    def _slope(self) -> float | None:
        """Shape per extra row (the cost curve's units), from the two most distant measured row counts."""
        if len(self.step_cost) < 2:
            return None
        lo, hi = min(self.step_cost), max(self.step_cost)
        return max((self.step_cost[hi] - self.step_cost[lo]) / (hi - lo), 0.0)

    # ---- the decision -------------------------------------------------------------------------
    def plan(self, proposals: dict[str, int], batch_rows: int) -> dict[str, int]:
        """proposals: request id -> drafts proposed; batch_rows: rows of the step without any draft.
        Returns how many of each request's drafts to keep."""
        self.num_plans += 1
        if not proposals:
            return {}
        every = self.every.get(batch_rows, self.explore_every)
        phase = self.num_plans % every
        if batch_rows not in self.step_cost or phase == every // 2:
            return dict.fromkeys(proposals, 0)  # measure the plain step
        if phase == 0 or not any(r > batch_rows for r in self.step_cost):
            if phase == 0 and self.kept.get(batch_rows) == 0:  # drafts lost since the last exploration
                self.every[batch_rows] = min(2 * every, MAX_EXPLORE_EVERY)
                # probe with one draft per request: it refreshes the first drafts' acceptance, which every
                # further draft's value rests on, for a fraction of an all-drafts step's cost
                return {rid: min(k, 1) for rid, k in proposals.items()}
            return dict(proposals)  # measure a step with every draft (and the acceptance rates)
        marginal = sorted((v, rid) for rid, k in proposals.items() for v in self.draft_values(rid, k))
        marginal.reverse()
        # The best prefix of the drafts sorted by value, not the first that stops paying: step cost is not
        # convex in rows (on the CPU a step of at most 20 rows runs packed few-row kernels whose cost grows
        # with every row, more rows the GEMMs, where a row costs far less).
        best, best_rate, tokens = 0, batch_rows / self.cost(batch_rows), float(batch_rows)
        needed = best_rate * (1 + MIN_GAIN)  # what a plan with drafts must beat
        for n, (gain, _) in enumerate(marginal, 1):
            tokens += gain
            rate = tokens / self.cost(batch_rows + n)
            if rate > best_rate and rate > needed:
                best, best_rate = n, rate
        keep = dict.fromkeys(proposals, 0)
        for _, rid in marginal[:best]:
            keep[rid] += 1
        self.kept[batch_rows] = best
        if best:
            self.every.pop(batch_rows, None)
        return keep

    def wants_proposals(self, batch_rows: int) -> bool:
        """Whether to run the proposer at all this step: proposing costs time too (the n-gram search over
        every running request), so while this batch size keeps no drafts it is asked only every
        RECHECK_EVERY plans, and on the exploration phases."""
        every = self.every.get(batch_rows, self.explore_every)
        phase = (self.num_plans + 1) % every  # the phase plan() will be in
        return self.kept.get(batch_rows, 1) > 0 or phase in (0, every // 2) or \
            (self.num_plans + 1) % RECHECK_EVERY == 0

    def skip(self) -> None:
        """A step planned without proposals (wants_proposals said no): it still counts as a plan."""
        self.num_plans += 1
