"""Prometheus metrics for the server, named like vLLM's (prefix `pagellm:` instead of `vllm:`).

Gauges and engine counters are read at scrape time from the async engine's last snapshot (taken in the
worker thread after each step), so a scrape never races a running step. Latency histograms are fed by
the async engine as outputs arrive. Each app gets its own CollectorRegistry: several servers (or tests)
in one process never collide in prometheus_client's global registry.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagellm.engine.async_engine import AsyncLLMEngine

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Turns the engine snapshot into gauge and counter families on every scrape."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pagellm:{name}", doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pagellm:{name}", doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).",
                    s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by live requests (1 = full).",
                    s.kv_cache_usage)
        yield counter("prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions)
        yield counter("num_swapped_out", "Preempted requests whose KV blocks were copied to host memory.",
                      s.num_swapped_out)
        yield counter("num_swapped_in", "Swapped-out requests whose KV blocks were copied back.", s.num_swapped_in)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", s.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                      s.spec_accepted_tokens)
        yield counter("spec_decode_num_drafts", "Request-steps that verified drafts.", s.spec_steps)
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.",
                    s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0)
        yield gauge("spec_decode_mean_acceptance_length", "Tokens per verifying step (accepted drafts + 1).",
                    1 + s.spec_accepted_tokens / s.spec_steps if s.spec_steps else 0.0)
        yield counter("prefix_cache_queries", "Tokens looked up in the prefix cache.", s.prefix_queries)
        yield counter("prefix_cache_hits", "Tokens found in the prefix cache.", s.prefix_hits)
        done = CounterMetricFamily("pagellm:request_success", "Finished requests by finish reason.",
                                   labels=["model_name", "finished_reason"])
        # Always expose the usual reasons, so a dashboard sees zeros rather than missing series.
        for reason in sorted({"stop", "length", "abort", *s.finished}):
            done.add_metric([self.model_name, reason], s.finished.get(reason, 0))
        yield done


class EngineMetrics:
    """The registry of one server; also the async engine's RequestObserver."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pagellm:{name}", doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive outputs of a request.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token, finished requests.",
                        _E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduling, finished requests.",
                          _E2E_BUCKETS)
        engine.observer = self

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(max(seconds, 0.0))

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(max(seconds, 0.0))

    def observe_finished(self, e2e: float, queue_time: float | None) -> None:
        self.e2e.observe(max(e2e, 0.0))
        if queue_time is not None:
            self.queue.observe(max(queue_time, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
