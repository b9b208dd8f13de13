"""Prometheus metrics of a server, with the names vLLM users know (prefix `jaxserve:`).

Engine figures (queue sizes, KV usage, token and cache counters) are read from
the engine's stats snapshot at scrape time; request latencies are observed by
the servicer. Each server has its own registry: no process-global state.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class _EngineCollector:
    def __init__(
        self, stats_fn, model_name: str, info_fn=None, replicas_fn=None, lifecycle_fn=None
    ):
        self._stats_fn = stats_fn
        self._info_fn = info_fn or (lambda: None)
        self._replicas_fn = replicas_fn or (lambda: None)
        self._lifecycle_fn = lifecycle_fn or (lambda: None)
        self._labels = ("model_name",), (model_name,)

    def _family(self, cls, name, doc, value):
        family = cls(name, doc, labels=self._labels[0])
        family.add_metric(self._labels[1], value)
        return family

    def collect(self):
        s = self._stats_fn()
        if s is None:  # the engine is still loading
            return
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(
            g, "jaxserve:num_requests_running", "Requests in the running batch.", s.num_running
        )
        yield self._family(
            g, "jaxserve:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting
        )
        yield self._family(
            g,
            "jaxserve:kv_cache_usage_perc",
            "Fraction of KV pages held by running requests (0-1).",
            s.kv_cache_usage,
        )
        yield self._family(
            c, "jaxserve:prefix_cache_queries", "Prompt tokens looked up.", s.prefix_cache_queries
        )
        yield self._family(
            c, "jaxserve:prefix_cache_hits", "Prompt tokens found cached.", s.prefix_cache_hits
        )
        yield self._family(
            c, "jaxserve:num_preemptions", "Preemptions by recompute.", s.num_preemptions
        )
        yield self._family(c, "jaxserve:prompt_tokens", "Prompt tokens computed.", s.prompt_tokens)
        yield self._family(
            c, "jaxserve:generation_tokens", "Tokens generated.", s.generation_tokens
        )
        yield self._family(
            c, "jaxserve:compilations", "XLA compilations in this process.", s.num_compiles
        )
        yield self._family(
            c,
            "jaxserve:spec_decode_num_drafts",
            "Speculative decoding: sequence-steps that verified drafts.",
            s.spec_decode_num_drafts,
        )
        yield self._family(
            c,
            "jaxserve:spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            s.spec_decode_num_draft_tokens,
        )
        yield self._family(
            c,
            "jaxserve:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            s.spec_decode_num_accepted_tokens,
        )
        per_pos = c(
            "jaxserve:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the draft.",
            labels=(*self._labels[0], "position"),
        )
        for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric((*self._labels[1], str(pos)), n)
        yield per_pos
        for name, doc in _TIER_COUNTERS:
            yield self._family(c, f"jaxserve:{name}", doc, getattr(s, name))
        for name, doc in _TIER_GAUGES:
            yield self._family(g, f"jaxserve:{name}", doc, getattr(s, name))
        yield from self._mesh()
        yield from self._lora(s)
        lifecycle = self._lifecycle_fn()
        if lifecycle is not None:
            paused, sleeping, version = lifecycle
            yield self._family(
                g, "jaxserve:engine_paused", "1 while generation is paused.", int(paused)
            )
            yield self._family(
                g, "jaxserve:engine_sleeping", "1 while the engine sleeps.", int(sleeping)
            )
            yield self._family(
                g, "jaxserve:weight_version", "The version of the weights served.", version
            )

    def _lora(self, s):
        """With LoRA enabled: the slots' use, loads and evictions, and the requests
        running and waiting per adapter (`lora_name` label), also as vLLM's
        `lora_requests_info` (the adapters' names as labels, the time as value)."""
        if not s.lora_slots:
            return
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(
            g, "jaxserve:lora_slots", "LoRA adapter slots on the device.", s.lora_slots
        )
        yield self._family(
            g, "jaxserve:lora_slots_in_use", "LoRA slots holding an adapter.", s.lora_slots_in_use
        )
        yield self._family(
            c, "jaxserve:lora_loads", "LoRA adapters written into a device slot.", s.lora_loads
        )
        yield self._family(
            c,
            "jaxserve:lora_evictions",
            "LoRA slot writes that replaced a resident adapter.",
            s.lora_evictions,
        )
        for state in ("running", "waiting"):
            family = g(
                f"jaxserve:lora_requests_{state}",
                f"Requests {state}, per LoRA adapter.",
                labels=(*self._labels[0], "lora_name"),
            )
            for name, n in getattr(s, f"lora_requests_{state}"):
                family.add_metric((*self._labels[1], name), n)
            yield family
        info = g(
            "jaxserve:lora_requests_info",
            "Running and waiting LoRA adapters (comma-separated names); the value is the time.",
            labels=("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
        )
        info.add_metric(
            (
                ",".join(name for name, _ in s.lora_requests_running),
                ",".join(name for name, _ in s.lora_requests_waiting),
                str(s.lora_slots),
            ),
            time.time(),
        )
        yield info

    def _mesh(self):
        """The mesh (tp, dp, processes as labels; devices the value), the KV bytes per
        device, and with data-parallel replicas each one's queue and KV usage."""
        info = self._info_fn()
        if info is not None:
            mesh = GaugeMetricFamily(
                "jaxserve:mesh_devices",
                "Devices serving, by tensor/data parallel size and process count.",
                labels=(*self._labels[0], "tp", "dp", "processes"),
            )
            mesh.add_metric(
                (
                    *self._labels[1],
                    str(info.tensor_parallel_size),
                    str(info.data_parallel_size),
                    str(info.num_processes),
                ),
                info.num_devices,
            )
            yield mesh
            yield self._family(
                GaugeMetricFamily,
                "jaxserve:kv_cache_bytes_per_device",
                "Bytes of KV cache on each device.",
                info.kv_cache_bytes_per_device,
            )
        replicas = self._replicas_fn()
        if replicas:
            for name, doc, field in (
                ("num_requests_running", "Requests running, per replica.", "num_running"),
                ("num_requests_waiting", "Requests waiting, per replica.", "num_waiting"),
                ("kv_cache_usage_perc", "KV pages in use (0-1), per replica.", "kv_cache_usage"),
            ):
                family = GaugeMetricFamily(
                    f"jaxserve:replica_{name}", doc, labels=(*self._labels[0], "replica")
                )
                for i, r in enumerate(replicas):
                    family.add_metric((*self._labels[1], str(i)), getattr(r, field))
                yield family


_TIER_COUNTERS = (
    ("kv_tier_hits", "KV tier: pages a prefix lookup found in host memory or on disk."),
    ("kv_tier_loads", "KV tier: pages copied back to the device instead of recomputed."),
    ("kv_tier_load_bytes", "KV tier: bytes copied back to the device."),
    ("kv_tier_stores", "KV tier: pages evicted from the device and stored."),
    ("kv_tier_store_bytes", "KV tier: bytes stored."),
    ("kv_tier_errors", "KV tier: pages refused (corrupt or foreign) or failed disk I/O."),
    ("kv_tier_host_evictions", "KV tier: pages dropped from host memory (LRU, kv_offload_bytes)."),
    (
        "kv_tier_disk_evictions",
        "KV tier: page files removed from disk (LRU, kv_tier_disk_max_bytes).",
    ),
)
_TIER_GAUGES = (
    ("kv_tier_host_bytes", "KV tier: bytes of pages held in host memory."),
    ("kv_tier_disk_bytes", "KV tier: bytes of page files on disk."),
)


class ServerMetrics:
    def __init__(
        self, model_name: str, stats_fn, *, info_fn=None, replicas_fn=None, lifecycle_fn=None
    ):
        """`stats_fn()` returns the engine's StatsSnapshot, or None before it exists;
        `info_fn()` its ModelInfo (the mesh), `replicas_fn()` each data-parallel
        replica's StatsSnapshot (None: one engine), `lifecycle_fn()` whether it is
        (paused, sleeping) and the version of its weights."""
        self.registry = CollectorRegistry()
        self.registry.register(
            _EngineCollector(stats_fn, model_name, info_fn, replicas_fn, lifecycle_fn)
        )
        kw = dict(registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram(
            "jaxserve:time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            **kw,
        )
        self.itl = Histogram(
            "jaxserve:inter_token_latency_seconds",
            "Time between consecutive streamed tokens.",
            **kw,
        )
        self.e2e = Histogram(
            "jaxserve:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            **kw,
        )
        self.requests = Counter(
            "jaxserve:request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "jaxserve:request_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=self.registry,
        )

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Starts the /metrics HTTP endpoint on its own port; returns the server."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server
