"""Prometheus metrics for the server: vLLM's (V1) names, types and labels, under `pagellm:` and, with
`--vllm-metric-names`, also under `vllm:`, so dashboards built for vLLM work unchanged.

Gauges and engine counters are read at scrape time from the async engine's last snapshot (taken in the
worker thread after each step), so a scrape never races a running step. Histograms are fed by the async
engine (its RequestObserver) on the event loop, the same thread that renders a scrape. Each app has its own
CollectorRegistry: several servers (or tests) in one process never collide in prometheus_client's global
registry. Every series carries vLLM's labels `model_name` and `engine` (always "0": one engine).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pagellm.engine.engine_front import EngineFront
from pagellm.engine.request_stats import FinishedRequest
from pagellm.engine.request_stream import EngineSnapshot

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics", "PREFIXES"]

PREFIXES = ("pagellm", "vllm")
_LABELS = ["model_name", "engine"]

# vLLM's buckets where a CPU engine's values fit them; the inter-token buckets start lower (a tiny model
# decodes in a millisecond or two).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _Histogram:
    """Bucket counts kept once, exported under every prefix (prometheus_client's Histogram has one name)."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float]):
        self.name = name
        self.doc = doc
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        value = max(float(value), 0.0)  # clocks can step back a hair between threads
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, prefix: str, labels: list[str]) -> HistogramMetricFamily:
        h = HistogramMetricFamily(f"{prefix}:{self.name}", self.doc, labels=_LABELS)
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        h.add_metric(labels, buckets, self.sum)
        return h


class EngineMetrics:
    """The registry of one server; also the async engine's RequestObserver."""

    def __init__(self, engine: EngineFront, model_name: str, vllm_names: bool = False):
        self.engine = engine
        self.labels = [model_name, "0"]
        self.prefixes = PREFIXES if vllm_names else PREFIXES[:1]
        self.cache_info = dict(engine.info.cache_info)  # vLLM's cache_config_info labels, plus pagellm's own
        max_len = engine.max_model_len
        h = self._hist = {}

        def hist(name: str, doc: str, buckets) -> _Histogram:
            h[name] = _Histogram(name, doc, buckets)
            return h[name]

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        _ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Histogram of time per output token in seconds. "
                         "DEPRECATED: Use inter_token_latency_seconds instead.", _ITL_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        _REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          _REQUEST_BUCKETS)
        self.inference = hist("request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", _REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                            _REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                           _REQUEST_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.",
                                  buckets_1_2_5(max_len))
        self.generation_tokens = hist("request_generation_tokens", "Number of generation tokens processed.",
                                      buckets_1_2_5(max_len))
        self.max_generation_tokens = hist("request_max_num_generation_tokens",
                                          "Histogram of maximum number of requested generation tokens.",
                                          buckets_1_2_5(max_len))
        self.params_n = hist("request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                      buckets_1_2_5(max_len))
        self.iteration_tokens = hist("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     _ITERATION_BUCKETS)
        self.registry = CollectorRegistry()
        self.registry.register(self)
        # process_resident_memory_bytes & co. (Linux /proc): the soak benchmark reads the server's RSS here;
        # engine_core_process_* are the engine core process's (`pagellm serve`'s default), which holds the model.
        ProcessCollector(registry=self.registry)
        core_pid = getattr(engine, "core_pid", None)
        if core_pid is not None:
            ProcessCollector(namespace="engine_core", pid=lambda: core_pid, registry=self.registry)
        engine.observer = self

    # ---- RequestObserver (event loop thread) ------------------------------------------------------
    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def observe_iteration(self, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)

    def observe_finished(self, r: FinishedRequest) -> None:
        for hist, value in ((self.e2e, r.e2e), (self.queue, r.queue_time), (self.prefill, r.prefill_time),
                            (self.decode, r.decode_time), (self.inference, r.inference_time),
                            (self.request_tpot, r.time_per_output_token),
                            (self.prompt_tokens, r.num_prompt_tokens),
                            (self.generation_tokens, r.num_generation_tokens),
                            (self.max_generation_tokens, r.max_generation_tokens), (self.params_n, r.n)):
            hist.observe(value)
        if r.max_tokens is not None:
            self.params_max_tokens.observe(r.max_tokens)

    # ---- scrape --------------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        for prefix in self.prefixes:
            yield from self._engine_families(prefix, s)
            for hist in self._hist.values():
                yield hist.family(prefix, self.labels)

    def _engine_families(self, prefix: str, s: EngineSnapshot) -> Iterator[Metric]:
        labels = self.labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=_LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{prefix}:{name}", doc, labels=_LABELS)
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed (incl. preempted).",
                    s.num_waiting)
        yield gauge("num_requests_swapped", "Number of requests swapped to CPU (vLLM v0 name; pagellm swaps "
                    "with --preemption-mode swap).", s.num_swapped)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield gauge("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. "
                    "DEPRECATED: Use kv_cache_usage_perc instead.", s.kv_cache_usage)
        info = GaugeMetricFamily(f"{prefix}:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self.cache_info))
        info.add_metric(list(self.cache_info.values()), 1)
        yield info
        yield counter("prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_queries)
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hits)
        yield counter("gpu_prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens. "
                      "DEPRECATED: Use prefix_cache_queries instead.", s.prefix_queries)
        yield counter("gpu_prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens. "
                      "DEPRECATED: Use prefix_cache_hits instead.", s.prefix_hits)
        done = CounterMetricFamily(f"{prefix}:request_success", "Count of successfully processed requests.",
                                   labels=[*_LABELS, "finished_reason"])
        # Always the usual reasons, so a dashboard sees zeros rather than missing series.
        for reason in sorted({"stop", "length", "abort", *s.finished}):
            done.add_metric([*labels, reason], s.finished.get(reason, 0))
        yield done
        yield counter("spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_steps)
        yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.spec_accepted_tokens)
        per_pos = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*_LABELS, "position"])
        for pos, count in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([*labels, str(pos)], count)
        yield per_pos
        # pagellm's own: swap traffic, and the acceptance ratios vLLM leaves to PromQL.
        yield counter("num_swapped_out", "Preempted requests whose KV blocks were copied to host memory.",
                      s.num_swapped_out)
        yield counter("num_swapped_in", "Swapped-out requests whose KV blocks were copied back.", s.num_swapped_in)
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.",
                    s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0)
        yield gauge("spec_decode_mean_acceptance_length", "Tokens per verifying step (accepted drafts + 1).",
                    1 + s.spec_accepted_tokens / s.spec_steps if s.spec_steps else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
