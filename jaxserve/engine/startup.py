"""What an engine sets up once: the KV pages' keepers, the speculative proposer and the
compiled programs (warmed up, or loaded from a bundle); and, for the edges that opt in (the command
line, `LLM(compilation_cache_dir=...)`, a Ray replica's process), JAX's persistent
compilation cache, which is process-wide: an engine never sets it.

Device side: it sets JAX's config and drives the runner's warm-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxserve.compile_cache import use_file_cache
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.kv import PagePool
from jaxserve.kv.connector import KVConnector
from jaxserve.kv.groups import KVGroups
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import KVLayout
from jaxserve.lora.manager import SlotTable
from jaxserve.scheduler import Scheduler
from jaxserve.spec import NgramProposer

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.targets import Target

COMPILATION_CACHE_BYTES = 4 << 30  # the persistent compilation cache's bound


def use_compilation_cache(directory: str) -> None:
    """Points JAX's persistent compilation cache (process-wide, for the rest of the
    process: JAX opens it at the first compilation and keeps it) at `directory`."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)
    # Processes share it (servers, replicas, CLI runs, tests): entries written whole,
    # read without a lock (JAX's own cache locks each read and write, and lists the
    # whole directory at each write).
    use_file_cache()


def kv_keepers(
    config: EngineConfig,
    runner: ModelRunner,
    layout: Callable[[], KVLayout],
    lora: SlotTable | None = None,
) -> tuple[KVTier | None, KVConnector | None, PagePool, Scheduler]:
    """The KV pages' keepers: the tier and its connector (with offload; `layout()`:
    the engine's KV layout), the pool and the scheduler that hands its pages out.
    A hybrid KV cache has a pool per layer group (`runner.group_pages`, the
    scheduler's `kv`); the pool returned is group 0's."""
    spec = config.speculative
    tier = connector = None
    if config.cache.offload:
        cache = config.cache
        tier = KVTier(layout(), cache.offload_bytes, cache.offload_dir, cache.disk_max_bytes)
        connector = KVConnector(tier, runner)
    group_pages = getattr(runner, "group_pages", None)
    if group_pages is None:  # a test double of a runner: one pool for every layer
        group_pages, windows = (runner.num_pages,), [None]
    else:
        windows = [g.window for g in config.kv_groups]
    pools = [
        PagePool(
            n,
            enable_prefix_caching=config.scheduler.enable_prefix_caching,
            track_evictions=tier is not None,
        )
        for n in group_pages
    ]
    pool = pools[0]
    scheduler = Scheduler(
        config.scheduler,
        pool,
        page_size=config.cache.page_size,
        seed=config.seed,
        spec_max_batch=spec.disable_by_batch_size if spec else 0,
        tier=tier,
        token_buckets=runner.shapes.token_buckets,
        kv=KVGroups(pools, windows, config.cache.page_size),
        lora=lora,  # the adapters' device slots (multi-LoRA)
    )
    return tier, connector, pool, scheduler


class Lookahead:
    """The draft model's stand-in before scheduling: how many tokens to make room
    for (placeholders; `DraftRunner` proposes the real ones after scheduling)."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, token_ids, limit: int | None = None) -> list[int]:
        return [-1] * min(self.k, self.k if limit is None else limit)


def make_proposer(spec: SpeculativeConfig | None) -> NgramProposer | Lookahead | None:
    """The proposer of the scheduler's lookahead tokens, if the engine speculates."""
    if spec is not None and spec.method == "ngram":
        return NgramProposer(
            min_n=spec.prompt_lookup_min,
            max_n=spec.prompt_lookup_max,
            k=spec.num_speculative_tokens,
        )
    elif spec is not None:  # draft_model: proposals are made after scheduling
        return Lookahead(spec.num_speculative_tokens)
    return None


def load_or_warm_up(
    config: EngineConfig,
    runner: ModelRunner,
    kv_transfer: bool,
    target: Target | None,
    *,
    now: bool = False,
) -> dict:
    """Warm-up's programs by name: the bundle's (`compiled_dir`), or compiled now
    (`warmup`, `now`, or for a compile-only `target`); none otherwise. `kv_transfer`:
    with the KV tier's gather/scatter programs."""
    drafter = runner.drafter
    compiled: dict = {}
    if config.compiled_dir:  # warm-up loads the bundle's programs instead
        compiled = runner.load_compiled(config.compiled_dir, kv_transfer=kv_transfer)
        if drafter:
            drafter.use_compiled(compiled)
    elif config.warmup or now or target is not None:
        extras = [drafter.lower_all] if drafter else []
        if runner.lora is not None:  # the adapters' slot write
            extras.append(lambda abstract: runner.lora.lower(runner.weights, abstract))
        if kv_transfer:
            extras.append(runner.lower_kv_io)
        compiled = runner.warmup(
            (lambda abstract: [p for f in extras for p in f(abstract)]) if extras else None
        )
        if drafter:
            drafter.warmed_up = True
    return compiled


__all__ = [
    "COMPILATION_CACHE_BYTES",
    "Lookahead",
    "load_or_warm_up",
    "make_proposer",
    "use_compilation_cache",
]
