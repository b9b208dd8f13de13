"""What an engine reports about itself: its model and capacity (`ModelInfo`) and
its counters and gauges now (`StatsSnapshot`), read off its pieces."""

from __future__ import annotations

import collections

from jaxserve.engine_stats import StatsSnapshot
from jaxserve.outputs import ModelInfo


def model_info(c, runner) -> ModelInfo:
    """`LLMEngine.model_info`: the model, its limits and what the runner holds."""
    return ModelInfo(
        model_dir=c.model_dir,
        architecture=c.model.architecture,
        vocab_size=c.model.vocab_size,
        max_model_len=c.max_model_len,
        max_num_seqs=c.scheduler.max_num_seqs,
        dtype=c.dtype,
        kv_cache_dtype=c.kv_dtype,
        quantization=c.quantization,
        block_size=c.cache.page_size,
        kv_cache_tokens=runner.kv_tokens,
        weight_bytes=runner.weight_bytes,
        warmup_seconds=runner.warmup_seconds,
        max_logit_bias=c.max_logit_bias,
        logprobs_mode=c.logprobs_mode,
        tensor_parallel_size=runner.layout["tp"],
        num_devices=runner.layout["devices"],
        num_processes=runner.layout["processes"],
        kv_cache_bytes_per_device=runner.kv_bytes_per_device,
        kv_tier_bytes=c.cache.offload_bytes if c.cache.offload else 0,
    )


def stats(scheduler, pool, runner, counters, tier, adapters=None) -> StatsSnapshot:
    """`LLMEngine.stats`: the scheduler's queues, the pool's use, the compile count,
    the engine's counters (`counters`, its EngineStats), the KV tier's and the LoRA
    adapters' (`adapters`, its EngineAdapters, if any)."""
    return StatsSnapshot(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_cache_usage=scheduler.kv.usage,  # (the fullest layer group's)
        prefix_cache_queries=scheduler.prefix_queries,
        prefix_cache_hits=scheduler.prefix_hits,
        num_preemptions=scheduler.num_preemptions,
        num_compiles=runner.compiles.count,
        **counters.counters(),
        **_tier_stats(tier),
        **_lora_stats(adapters, scheduler),
    )


def _lora_stats(adapters, scheduler) -> dict:
    """The slots' use and, per adapter name, the requests running and waiting: each
    of a request's n samples counts (vLLM's engine runs them as requests of their own)."""
    if adapters is None:
        return {}
    slots = adapters.slots
    names = {a.key: a.request.lora_name for a in adapters.cache.adapters()}

    def per_adapter(seqs) -> tuple[tuple[str, int], ...]:
        counts = collections.Counter(names.get(s.lora_key, s.lora_key) for s in seqs)
        return tuple(sorted((name, n) for name, n in counts.items() if name is not None))

    return dict(
        lora_slots=slots.num_slots,
        lora_slots_in_use=slots.num_in_use,
        lora_loads=slots.num_loads,
        lora_evictions=slots.num_evictions,
        lora_requests_running=per_adapter(scheduler.running),
        lora_requests_waiting=per_adapter(scheduler.waiting),
    )


def _tier_stats(tier) -> dict[str, int]:
    if tier is None:
        return {}
    t = tier.stats
    return dict(
        kv_tier_hits=t.hits,
        kv_tier_loads=t.loads,
        kv_tier_load_bytes=t.load_bytes,
        kv_tier_stores=t.stores,
        kv_tier_store_bytes=t.store_bytes,
        kv_tier_errors=t.errors,
        kv_tier_host_bytes=tier.host_used,
        kv_tier_disk_bytes=tier.disk_used,
        kv_tier_host_evictions=t.host_evictions,
        kv_tier_disk_evictions=tier.disk_evictions,
    )
