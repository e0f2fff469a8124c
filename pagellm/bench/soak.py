"""`pagellm bench soak`: hours of mixed, partly hostile traffic against a running server, then proof that
nothing was lost and nothing leaked.

Phases, each with a deadline: the server's RSS on arrival; canaries on the idle server (their answers
become the reference); a sweep that writes every KV block once (so first-touch paging of the KV cache is
not mistaken for a leak); a warm-up of the same traffic, drain, RSS again; the soak itself for --duration
(traffic at --rate, --burst floods, canaries repeated throughout, /metrics sampled); wait for every
request, drain, read /metrics a last time. Loopback servers only: this is a load and fuzzing tool.
The figures that must be zero (lost, 5xx, canary mismatches, ...) set the exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import random
import sys
import time
from urllib.parse import urlsplit

from pagellm import cli_types
from pagellm.bench.common import served_model
from pagellm.bench.report import plot_written, write_json
from pagellm.bench.soak_report import checks, plot_soak, print_summary, summarize
from pagellm.bench.soak_traffic import CANARY_PROMPTS, Outcome, Spec, TrafficMix, send

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
MAX_DURATION = 30 * 86400.0  # a longer one (or inf) is a typo, not a soak

_IDLE_SETTLE_S = 2.0  # idle time before an RSS reading (see settle)


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '1.5h' -> seconds."""
    t = text.strip().lower()
    scale = UNITS.get(t[-1:], None)
    try:
        value = float(t[:-1] if scale else t) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90s, 10m or 1h") from None
    if not 0 < value <= MAX_DURATION:  # nan and inf too
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive and at most 30 days")
    return value


def parse_burst(text: str) -> tuple[int, float]:
    """'N@T': N requests at once, T (a duration) after the soak phase began."""
    n, sep, at = text.partition("@")
    if not sep or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"--burst {text!r}: expected N@T, e.g. 100@5m")
    return int(n), parse_duration(at) if at.strip() not in ("0", "0s") else 0.0


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1]") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1]")
    return v


def loopback_base(url: str) -> str:
    """The base URL if its host is loopback (127.0.0.0/8, ::1, localhost), else ValueError."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    host = parts.hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if parts.scheme not in ("http", "https") or not ok:
        raise ValueError(f"--url {url!r}: the soak only targets a loopback server (127.0.0.0/8, ::1 or localhost)")
    return url.rstrip("/").removesuffix("/v1")


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL on this machine, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--duration", type=parse_duration, default=parse_duration("10m"),
                   help="length of the soak phase, e.g. 60s, 10m, 1h (default 10m)")
    p.add_argument("--warmup", type=parse_duration, default=None,
                   help="warm-up traffic before the RSS reference (default: 10%% of --duration, 5 s to 60 s)")
    p.add_argument("--rate", type=cli_types.positive_number, default=2.0,
                   help="mean requests/s, Poisson arrivals (default 2)")
    p.add_argument("--max-concurrency", type=cli_types.positive_int, default=32,
                   help="at most this many regular requests in flight; bursts come on top (default 32)")
    p.add_argument("--burst", type=parse_burst, action="append", default=None, metavar="N@T",
                   help="N requests at once, T into the soak phase (repeatable; default 100 at half time)")
    p.add_argument("--disconnect-frac", type=_fraction, default=0.2,
                   help="streams the client closes after 1-4 chunks (default 0.2)")
    p.add_argument("--malformed-frac", type=_fraction, default=0.05, help="malformed requests (default 0.05)")
    p.add_argument("--cancel-frac", type=_fraction, default=0.05,
                   help="requests the client abandons before the first token (default 0.05)")
    p.add_argument("--canaries", type=int, default=4, metavar="K",
                   help=f"greedy canary prompts (at most {len(CANARY_PROMPTS)}, default 4)")
    p.add_argument("--canary-interval", type=parse_duration, default=parse_duration("5s"),
                   help="one canary every this long during the soak (default 5s)")
    p.add_argument("--request-timeout", type=parse_duration, default=parse_duration("5m"),
                   help="a request without a final answer after this long counts as lost (default 5m)")
    p.add_argument("--drain-timeout", type=parse_duration, default=parse_duration("2m"),
                   help="how long the server may take to go idle after the traffic (default 2m)")
    p.add_argument("--max-requests", type=cli_types.positive_int, default=None,
                   help="cap on requests sent (default: 3 x rate x (warm-up + duration) + bursts + 1000)")
    p.add_argument("--max-rss-drift", type=cli_types.nonnegative_number, default=0.05,
                   help="allowed RSS growth from after warm-up to after drain (default 0.05 = 5%%)")
    p.add_argument("--metrics-interval", type=parse_duration, default=parse_duration("5s"),
                   help="how often /metrics is sampled for the plot (default 5s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic mix and arrival times")
    p.add_argument("--server-command", default=None, help="the server's command line, recorded in the JSON")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="draw the figures over time (matplotlib)")


async def scrape(client, base: str) -> dict:
    """The /metrics figures the soak checks."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get(base + "/metrics")
    r.raise_for_status()
    out: dict = {"t": time.time()}
    names = {"pagellm:num_requests_running": "running", "pagellm:num_requests_waiting": "waiting",
             "pagellm:kv_cache_usage_perc": "kv_usage", "process_resident_memory_bytes": "rss_bytes",
             "engine_core_process_resident_memory_bytes": "core_rss_bytes"}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] = s.value
            elif s.name == "pagellm:cache_config_info":
                out["num_blocks"] = int(s.labels.get("num_gpu_blocks", 0))
                out["block_size"] = int(s.labels.get("block_size", 0))
    if "rss_bytes" in out:  # the server's RSS: with an engine core process, both processes'
        out["rss_bytes"] += out.pop("core_rss_bytes", 0.0)
    if "kv_usage" in out and "num_blocks" in out:
        out["blocks_in_use"] = round(out["kv_usage"] * out["num_blocks"])
    return out


class Soak:
    def __init__(self, ns, client, base: str, model: str, max_len: int):
        self.ns, self.client, self.base = ns, client, base
        self.mix = TrafficMix(model, max_len, ns.seed, ns.disconnect_frac, ns.cancel_frac, ns.malformed_frac)
        self.arrivals = random.Random(ns.seed + 1)
        self.outcomes: list[tuple[str, Outcome]] = []  # (phase, outcome)
        self.samples: list[dict] = []  # /metrics over time, with "s" (seconds since t0) and "phase"
        self.reference: dict[int, tuple] = {}
        self.t0 = time.perf_counter()
        self.phase = "start"
        self.tasks: set[asyncio.Task] = set()
        self.sent = 0
        self.cap = ns.max_requests

    async def one(self, spec: Spec, sem: asyncio.Semaphore | None = None) -> Outcome:
        try:
            out = await send(self.client, self.base, spec, self.t0, self.ns.request_timeout)
        finally:
            if sem is not None:
                sem.release()
        self.outcomes.append((self.phase, out))
        return out

    def launch(self, spec: Spec, sem: asyncio.Semaphore | None = None) -> bool:
        if self.sent >= self.cap:
            return False
        self.sent += 1
        task = asyncio.create_task(self.one(spec, sem))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def sample(self, phase: str) -> dict:
        m = await scrape(self.client, self.base)
        m.update(s=round(self.now(), 2), phase=phase)
        self.samples.append(m)
        return m

    async def canary_reference(self) -> None:
        """Each canary on the idle server, twice: the two answers must already agree."""
        for i in range(self.ns.canaries):
            first = await send(self.client, self.base, self.mix.canary(i), self.t0, self.ns.request_timeout)
            again = await send(self.client, self.base, self.mix.canary(i), self.t0, self.ns.request_timeout)
            self.outcomes += [(self.phase, first), (self.phase, again)]
            if first.answer is None or first.answer != again.answer:
                raise RuntimeError(f"canary {i} on the idle server: {first.answer or first.error or first.problem}"
                                   f" then {again.answer or again.error or again.problem}")
            self.reference[i] = first.answer
        self.sent += 2 * self.ns.canaries

    async def kv_sweep(self, start: dict) -> dict:
        """Touch every KV block once before the RSS reference. The cache is allocated up front but becomes
        resident page by page as blocks are first written, and the free queue hands out never-used blocks
        first: without this, RSS would climb until traffic had cycled through the whole cache and look like
        a leak. Unique prompts of half the context, max_tokens 1, until the cache's capacity was allocated."""
        capacity = start.get("num_blocks", 0) * start.get("block_size", 0)
        per = max(16, min(self.mix.max_len // 2, capacity))
        sent = tokens = 0
        deadline = time.monotonic() + self.ns.drain_timeout
        while tokens < capacity and time.monotonic() < deadline:
            spec = self.mix.sweep(per)
            out = await send(self.client, self.base, spec, self.t0, self.ns.request_timeout)
            self.outcomes.append((self.phase, out))
            sent += 1
            tokens += out.prompt_tokens
            if out.status != 200 or not out.prompt_tokens:
                break
        self.sent += sent
        return {"requests": sent, "prompt_tokens": tokens, "capacity_tokens": capacity}

    async def traffic(self, seconds: float, bursts: list[tuple[int, float]]) -> None:
        """Poisson arrivals (bounded by --max-concurrency), bursts and canaries until the deadline."""
        start = self.now()
        deadline = start + seconds
        sem = asyncio.Semaphore(self.ns.max_concurrency)
        timers = [asyncio.create_task(self._burst(n, start + at)) for n, at in bursts if at < seconds]
        timers.append(asyncio.create_task(self._canaries(deadline)))
        timers.append(asyncio.create_task(self._sampler(deadline)))
        at = start
        while self.sent < self.cap:
            at += self.arrivals.expovariate(self.ns.rate)
            if at >= deadline:
                break
            await asyncio.sleep(max(0.0, at - self.now()))
            try:
                await asyncio.wait_for(sem.acquire(), max(0.0, deadline - self.now()))
            except TimeoutError:
                break
            if not self.launch(self.mix.next(), sem):
                sem.release()
        await asyncio.sleep(max(0.0, deadline - self.now()))
        for t in timers:
            t.cancel()
        await asyncio.gather(*timers, return_exceptions=True)

    async def _burst(self, n: int, at: float) -> None:
        await asyncio.sleep(max(0.0, at - self.now()))
        for _ in range(n):
            self.launch(self.mix.burst())

    async def _canaries(self, deadline: float) -> None:
        i = 0
        while self.ns.canaries and self.now() + self.ns.canary_interval < deadline:
            await asyncio.sleep(self.ns.canary_interval)
            self.launch(self.mix.canary(i % self.ns.canaries))
            i += 1

    async def _sampler(self, deadline: float) -> None:
        while self.now() < deadline:
            await asyncio.sleep(self.ns.metrics_interval)
            try:
                await self.sample(self.phase)
            except Exception as e:  # noqa: BLE001 -- a failed scrape is a figure, not a crash
                self.samples.append({"s": round(self.now(), 2), "phase": self.phase, "error": str(e)[:200]})

    async def settle(self) -> dict:
        """Wait for the client's requests (each ends by its own timeout), then for the server to go idle."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=self.ns.request_timeout + 30)
        deadline = time.monotonic() + self.ns.drain_timeout
        while True:
            m = await self.sample(self.phase + "-drained")
            idle = m.get("running") == 0 and m.get("waiting") == 0 and m.get("kv_usage") == 0
            if idle or time.monotonic() > deadline:
                drain_s = round(self.ns.drain_timeout - max(0.0, deadline - time.monotonic()), 2)
                if idle:
                    # An idle pagellm server returns freed heap to the OS within a second (the async engine's
                    # malloc_trim); RSS read at once would land anywhere in the ~20% swing of a busy heap.
                    await asyncio.sleep(_IDLE_SETTLE_S)
                    m = await self.sample(self.phase + "-drained")
                m["drain_s"] = drain_s
                return m
            await asyncio.sleep(0.2)

    async def run(self, warmup: float, bursts: list[tuple[int, float]]) -> dict:
        start = await self.sample("start")
        self.phase = "canary-reference"
        await self.canary_reference()
        self.phase = "kv-sweep"
        sweep = await self.kv_sweep(start)
        self.phase = "warmup"
        await self.traffic(warmup, [])
        warm = await self.settle()
        self.phase = "soak"
        soak_start = self.now()
        await self.traffic(self.ns.duration, bursts)
        end = await self.settle()
        return {"start": start, "kv_sweep": sweep, "after_warmup": warm, "after_drain": end,
                "soak_start_s": round(soak_start, 2), "soak_end_s": round(self.now(), 2)}


async def _main(ns, warmup: float, bursts: list[tuple[int, float]]) -> dict:
    import httpx

    base = loopback_base(ns.url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(ns.request_timeout), limits=limits) as client:
        model, max_len = await served_model(client, base, ns.model, 2048)
        version = await client.get(base + "/version")
        soak = Soak(ns, client, base, model, max_len)
        phases = await soak.run(warmup, bursts)
    return {"model": model, "max_model_len": max_len, "server_version": version.json() if version.is_success
            else None, "phases": phases, "outcomes": soak.outcomes, "samples": soak.samples,
            "reference": soak.reference, "sent": soak.sent}


def _machine() -> dict:
    from pagellm.bench.common import machine_info
    from pagellm.platforms import get_platform

    d = get_platform("cpu").describe()
    return {**machine_info(), "cpu_model": d.get("cpu"), "isa": d.get("isa"), "kernels": d.get("kernels")}


def run_soak(ns: argparse.Namespace) -> int:
    loopback_base(ns.url)  # refuse before anything else
    if not 0 <= ns.canaries <= len(CANARY_PROMPTS):  # (--rate and --max-concurrency: their argparse types)
        raise ValueError(f"--canaries must be in 0..{len(CANARY_PROMPTS)}")
    warmup = ns.warmup if ns.warmup is not None else min(60.0, max(5.0, ns.duration / 10))
    bursts = ns.burst if ns.burst is not None else [(100, ns.duration / 2)]
    late = [f"{n}@{at:g}s" for n, at in bursts if at >= ns.duration]
    if late:
        raise ValueError(f"--burst {', '.join(late)}: after the soak's --duration of {ns.duration:g} s, it would "
                         "never fire")
    if ns.max_requests is None:
        ns.max_requests = int(3 * ns.rate * (warmup + ns.duration)) + sum(n for n, _ in bursts) + 1000
    if ns.plot:
        import matplotlib  # noqa: F401  -- fail before the run, not after it
    logging.getLogger("httpx").setLevel(logging.WARNING)
    machine = _machine()
    print(f"platform: cpu {machine['cpu_model']}; isa {machine['isa']}", flush=True)
    print(f"soak: warm-up {warmup:.0f} s, soak {ns.duration:.0f} s at {ns.rate}/s, bursts "
          f"{', '.join(f'{n}@{at:.0f}s' for n, at in bursts) or 'none'}, {ns.canaries} canaries", flush=True)
    t0 = time.time()
    raw = asyncio.run(_main(ns, warmup, bursts))
    results = summarize(raw)
    report = {"benchmark": "soak", "date": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
              "command": "pagellm " + " ".join(sys.argv[1:]), "server_command": ns.server_command,
              "machine": machine, "url": loopback_base(ns.url), "model": raw["model"],
              "max_model_len": raw["max_model_len"], "server_version": raw["server_version"],
              "settings": {"duration_s": ns.duration, "warmup_s": warmup, "rate": ns.rate,
                           "max_concurrency": ns.max_concurrency, "bursts": bursts,
                           "disconnect_frac": ns.disconnect_frac, "malformed_frac": ns.malformed_frac,
                           "cancel_frac": ns.cancel_frac, "canaries": ns.canaries, "seed": ns.seed,
                           "request_timeout_s": ns.request_timeout, "drain_timeout_s": ns.drain_timeout,
                           "max_requests": ns.max_requests},
              "wall_s": round(time.time() - t0, 1), **results}
    report["checks"] = checks(report, ns.max_rss_drift)
    print_summary(report)
    if ns.json:
        write_json(ns.json, report)
    if ns.plot:
        plot_soak(report, ns.plot)
        print(f"wrote {plot_written(ns.plot)}")
    failed = [name for name, c in report["checks"].items() if not c["ok"]]
    if failed:
        print(f"soak FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
