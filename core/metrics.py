"""Prometheus metrics for `flashnext serve` (names: docs/cli.md, all prefixed `flashnext_`).

Latencies and request outcomes are recorded as they happen; counters that live in the engine (preemptions, prefill
chunks, prefix hits, speculative-decoding counts, and the runner's stats(): graph counts where it keeps them) are
read at scrape time, so they are never out of step.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineCollector:
    """Reads the engine's own counters when /metrics is scraped."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine = self.engine
        runner, blocks, scheduler = engine.runner.stats(), engine.blocks, engine.scheduler
        spec = engine.spec_stats()
        yield _counter("cuda_graph_captures", "CUDA graphs captured", runner.graph_captures)
        yield _counter("cuda_graph_replays", "Steps run by replaying a CUDA graph", runner.graph_replays)
        yield GaugeMetricFamily(
            "flashnext_cuda_graph_memory_bytes",
            "Device memory reserved by CUDA graph captures",
            value=runner.graph_memory_bytes,
        )
        yield _counter(
            "chunked_prefill_chunks", "Prompt pieces run while the prompt was not yet whole", scheduler.prefill_chunks
        )
        yield _counter("preemptions", "Requests preempted (blocks freed, recomputed later)", scheduler.preemptions)
        yield _counter("prefix_cache_hits", "KV blocks served from the prefix cache", blocks.prefix_hits)
        yield _counter(
            "prefix_cache_queries", "Full prompt blocks looked up in the prefix cache", blocks.prefix_queries
        )
        yield _counter("spec_decode_drafts", "Speculative draft rounds", spec["drafts"])
        yield _counter("spec_decode_draft_tokens", "Tokens proposed by the drafter", spec["drafted"])
        yield _counter("spec_decode_accepted_tokens", "Draft tokens accepted by the target model", spec["accepted"])
        per_pos = CounterMetricFamily(
            "flashnext_spec_decode_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position",
            labels=["position"],
        )
        for position, count in enumerate(spec["accepted_per_position"]):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        if engine.profile.spec != "none":
            yield InfoMetricFamily(
                "flashnext_spec_decode_path",
                "Speculative decoding's method and where it drafts and verifies (graphs: inside captured steps)",
                value={"method": engine.profile.spec, "path": spec_path(runner)},
            )
        yield _counter("spec_decode_graph_steps", "Verify steps run inside captured graphs", runner.spec_graph_steps)
        yield GaugeMetricFamily(
            "flashnext_requests_running", "Requests in the running batch", value=len(scheduler.running)
        )
        yield GaugeMetricFamily(
            "flashnext_requests_waiting", "Requests queued for a running slot", value=len(scheduler.waiting)
        )
        used = blocks.num_blocks - blocks.num_free
        yield GaugeMetricFamily(
            "flashnext_kv_cache_usage_ratio", "Fraction of KV blocks held by requests", value=used / blocks.num_blocks
        )
        yield from device_metrics(engine.backend.device_telemetry())


def spec_path(stats) -> str:
    """Where speculation runs, from a runner's stats(): inside its steps (their name for it) or the engine's."""
    return stats.spec_path or "engine"


def device_metrics(telemetry: dict):
    """Backend.device_telemetry() as gauges; what the backend cannot read is left out, not reported as 0."""
    if "temperature_celsius" in telemetry:
        temps = GaugeMetricFamily(
            "flashnext_device_temperature_celsius", "Device temperature by sensor zone", labels=["zone"]
        )
        for zone, celsius in telemetry["temperature_celsius"].items():
            temps.add_metric([zone], celsius)
        yield temps
    for key, doc in (
        ("memory_clock_mhz", "Device memory clock now"),
        ("memory_clock_max_mhz", "Highest device memory clock"),
        ("gpu_clock_mhz", "Device compute clock now"),
        ("gpu_load_ratio", "Device compute load, 0 to 1"),
    ):
        if telemetry.get(key) is not None:
            yield GaugeMetricFamily(f"flashnext_device_{key}", doc, value=telemetry[key])
    if telemetry.get("power_mode") is not None:  # exposed as flashnext_device_power_mode_info{mode} 1
        yield InfoMetricFamily(
            "flashnext_device_power_mode", "Device power mode", value={"mode": str(telemetry["power_mode"])}
        )


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"flashnext_{name}", doc, value=value)


class ServerMetrics:
    """A registry of its own (not prometheus-client's global one), so several servers can live in one process."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "flashnext_time_to_first_token_seconds",
            "From arrival to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "flashnext_inter_token_latency_seconds",
            "Time between a request's generated tokens",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "flashnext_requests",
            "Requests by outcome: stop, length, abort, error, rejected",
            ["status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "flashnext_prompt_tokens", "Prompt tokens of the requests admitted", registry=self.registry
        )
        self.generation_tokens = Counter(
            "flashnext_generation_tokens", "Tokens generated for requests", registry=self.registry
        )
        self.registry.register(EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
