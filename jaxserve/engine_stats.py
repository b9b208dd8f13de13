"""Engine statistics: counters, gauges and the periodic stats log line (no JAX).

The same figures feed the Prometheus endpoint of the server.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StatsSnapshot:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of pages held by running sequences
    prefix_cache_queries: int  # prompt tokens looked up, once per sequence
    prefix_cache_hits: int  # of those, found cached
    num_preemptions: int
    prompt_tokens: int  # computed prompt tokens (recomputation included)
    generation_tokens: int
    requests_finished: int
    requests_aborted: int
    num_compiles: int
    steps: int = 0
    host_seconds: float = 0.0  # scheduling, input building, output processing
    device_seconds: float = 0.0  # waiting for the device (host bookkeeping overlapped)
    peak_kv_pages: int = 0  # most pages in use at once (a shared page counted once)
    kv_waste_at_peak: float = 0.0  # of those pages' slots, the fraction holding no token
    # Speculative decoding (vLLM's spec_decode_* counters).
    spec_decode_num_drafts: int = 0  # sequence-steps that verified drafts
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [k]: accepted at draft j
    # The host/disk KV tier (kv/tier.py), in pages and bytes.
    kv_tier_hits: int = 0  # pages a prefix lookup found in the tier
    kv_tier_loads: int = 0  # of those, copied back to the device
    kv_tier_load_bytes: int = 0
    kv_tier_stores: int = 0  # evicted pages stored in the tier
    kv_tier_store_bytes: int = 0
    kv_tier_errors: int = 0  # pages refused or disk operations failed (recomputed)
    kv_tier_host_bytes: int = 0  # gauge: bytes of pages held in host memory now
    kv_tier_disk_bytes: int = 0  # gauge: bytes of pages on disk now
    kv_tier_host_evictions: int = 0  # pages dropped from host memory (LRU, kv_offload_bytes)
    kv_tier_disk_evictions: int = 0  # pages removed from disk (LRU, kv_tier_disk_max_bytes)
    # Multi-LoRA (an engine with enable_lora; jaxserve/lora/manager.py).
    lora_slots: int = 0  # gauge: device slots (max_loras); 0: LoRA not enabled
    lora_slots_in_use: int = 0  # gauge: slots holding an adapter
    lora_loads: int = 0  # adapters written into a slot
    lora_evictions: int = 0  # of those, writes that replaced a resident adapter
    # Gauges: (adapter name, requests) for each adapter with requests running / waiting.
    lora_requests_running: tuple[tuple[str, int], ...] = ()
    lora_requests_waiting: tuple[tuple[str, int], ...] = ()

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a verifying step emits on average: 1 + accepted drafts (vLLM's)."""
        n = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def host_overhead(self) -> float:
        """Host time as a fraction of step time."""
        total = self.host_seconds + self.device_seconds
        return self.host_seconds / total if total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class EngineStats:
    """The engine's running counters. It holds no reference to the engine: the engine
    reports each step and finish, and builds a `StatsSnapshot` from these counters and
    its own gauges (`LLMEngine.stats()`)."""

    def __init__(self, *, page_size: int, interval_s: float):
        self.page_size = page_size
        self.interval_s = interval_s
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_added = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.steps = 0
        self.host_seconds = 0.0
        self.device_seconds = 0.0
        self.peak_kv_pages = 0
        self.kv_waste_at_peak = 0.0
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_per_pos: list[int] = []
        self._last_log = time.monotonic()
        self._last = (0, 0)

    def on_add(self) -> None:
        self.requests_added += 1

    def on_step(
        self,
        plan,
        num_sampled: int,
        running: Sequence,
        pages_in_use: int,
        *,
        host_s: float,
        device_s: float,
    ) -> None:
        """Counts one step; `running` are the scheduler's running sequences after it,
        `pages_in_use` the pages the pool has given out (each once, however many
        sequences share it: beams, forks, prefix hits)."""
        decode = sum(s.num_tokens for s in plan.scheduled if s.start >= s.seq.num_prompt_tokens)
        self.prompt_tokens += plan.num_tokens - decode
        self.generation_tokens += num_sampled
        self.steps += 1
        self.host_seconds += host_s
        self.device_seconds += device_s
        pages = pages_in_use
        if pages and pages >= self.peak_kv_pages:  # the latest step at the peak: fullest pages
            self.peak_kv_pages = pages
            # Slots holding no token: the tail of each sequence's last page, and pages
            # given ahead (a page shared by several holds its tokens once).
            empty = sum(len(s.pages) * self.page_size - s.num_computed for s in running)
            self.kv_waste_at_peak = min(1.0, max(0.0, empty / (pages * self.page_size)))

    def on_spec(self, num_draft: int, num_accepted: int) -> None:
        """One sequence verified `num_draft` drafts and accepted the first `num_accepted`."""
        self.spec_drafts += 1
        self.spec_draft_tokens += num_draft
        if len(self.spec_accepted_per_pos) < num_draft:
            self.spec_accepted_per_pos += [0] * (num_draft - len(self.spec_accepted_per_pos))
        for j in range(num_accepted):
            self.spec_accepted_per_pos[j] += 1

    def on_finish(self, *, aborted: bool = False) -> None:
        if aborted:
            self.requests_aborted += 1
        else:
            self.requests_finished += 1

    def counters(self) -> dict:
        """The StatsSnapshot fields these counters supply."""
        return dict(
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            requests_finished=self.requests_finished,
            requests_aborted=self.requests_aborted,
            steps=self.steps,
            host_seconds=self.host_seconds,
            device_seconds=self.device_seconds,
            peak_kv_pages=self.peak_kv_pages,
            kv_waste_at_peak=self.kv_waste_at_peak,
            spec_decode_num_drafts=self.spec_drafts,
            spec_decode_num_draft_tokens=self.spec_draft_tokens,
            spec_decode_num_accepted_tokens=sum(self.spec_accepted_per_pos),
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec_accepted_per_pos),
        )

    def log_due(self, now: float) -> bool:
        return self.interval_s > 0 and now - self._last_log >= self.interval_s

    def log(self, s: StatsSnapshot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        dt = max(now - self._last_log, 1e-9)
        prompt_tps = (s.prompt_tokens - self._last[0]) / dt
        gen_tps = (s.generation_tokens - self._last[1]) / dt
        spec = ""
        if s.spec_decode_num_drafts:
            spec = (
                f" | spec decode: mean acceptance length "
                f"{s.spec_decode_mean_acceptance_length:.2f}, "
                f"{s.spec_decode_num_accepted_tokens}/{s.spec_decode_num_draft_tokens} "
                "drafts accepted"
            )
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | "
            "KV cache %.1f%% | prefix cache hit rate %.1f%% | preemptions %d%s",
            prompt_tps,
            gen_tps,
            s.num_running,
            s.num_waiting,
            100 * s.kv_cache_usage,
            100 * s.prefix_cache_hit_rate,
            s.num_preemptions,
            spec,
        )
        self._last_log, self._last = now, (s.prompt_tokens, s.generation_tokens)
