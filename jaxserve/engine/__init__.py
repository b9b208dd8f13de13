"""The engine: requests in, tokens out, one compiled step at a time.

One job per module:

- `core`: `LLMEngine`, its wiring, public API and the loop that steps it;
- `startup`: the compilation cache, the KV pages' keepers, the speculative proposer,
  warm-up or a bundle;
- `validation`: a request checked against the model, limits and pool;
- `pipeline`: the step, sync and async: schedule, build, dispatch, fetch;
- `emission`: the sampled tokens applied: append, stop checks, drafts accepted;
- `grammars`: structured-output requests held until their grammar compiles;
- `disagg_io`: KV pages exported to and imported from another instance;
- `weight_sync`: new weights swapped in, the KV the old ones computed dropped.
- `lifecycle`: pause and sleep (RL rollouts beside a trainer), `LLMEngine`'s base.

`LLMEngine` is loaded on first use (`__getattr__`), so that the host-side modules of
the package (all but `core` and `startup`) import without JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.engine.validation import validate_request

if TYPE_CHECKING:
    from jaxserve.engine.core import LLMEngine


def __getattr__(name: str):
    if name == "LLMEngine":
        from jaxserve.engine.core import LLMEngine

        return LLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LLMEngine", "validate_request"]
