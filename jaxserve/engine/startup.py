"""What an engine sets up once: the speculative proposer and the compiled programs
(warmed up, or loaded from a bundle); and, for the edges that opt in (the command
line, `LLM(compilation_cache_dir=...)`, a Ray replica's process), JAX's persistent
compilation cache, which is process-wide: an engine never sets it.

Device side: it sets JAX's config and drives the runner's warm-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig, SpeculativeConfig
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
    # Processes share the cache (servers, CLI runs, tests). Unbounded, JAX
    # writes entries unlocked and another process can read one half-written,
    # which crashed a reader (a segfault deserializing it). Bounded, it
    # evicts the least recently used and locks (filelock) every read and write.
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)


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
    config: EngineConfig, runner: ModelRunner, kv_transfer: bool, target: Target | None
) -> dict:
    """Warm-up's programs by name: the bundle's (`compiled_dir`), or compiled now
    (`warmup`, or for a compile-only `target`); none otherwise. `kv_transfer`: with
    the KV tier's gather/scatter programs."""
    drafter = runner.drafter
    compiled: dict = {}
    if config.compiled_dir:  # warm-up loads the bundle's programs instead
        compiled = runner.load_compiled(config.compiled_dir, kv_transfer=kv_transfer)
        if drafter:
            drafter.use_compiled(compiled)
    elif config.warmup or target is not None:
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
