"""New weights for a running engine, and every KV page the old ones computed dropped.

`LLMEngine.update_weights` (RL rollouts: train and serve in one process):
  1. the new weights are converted and checked against the model
     (`ModelRunner.prepare_weights`): an error names the first mismatch, and
     nothing has changed. This step (`prepare`, reading a checkpoint from disk) may
     run on any thread while the engine steps: an engine front runs it on a worker
     thread, then the rest (`install`) on the engine's between two steps;
  2. the step in flight (asynchronous scheduling) is applied: its tokens were
     sampled with the old weights, and say so (`RequestOutput.weight_version`);
     the next `step()` returns its outputs;
  3. the runner swaps the arrays (same shapes, dtypes and placement: no program
     compiles again);
  4. every running sequence is preempted: it keeps the tokens it generated, and its
     KV (prompt and output) is recomputed with the new weights when it is
     rescheduled;
  5. no KV computed with the old weights is reused: the prefix cache forgets every
     page (in use or not), the evicted pages not yet copied to the KV tier are not
     copied, the copies in flight finish, then the tier drops every page, host and
     disk. Where the engine has a KV layout (a tier, or pages exported), it is made
     again: its model id samples the weights, so pages of the new weights carry
     another fingerprint (a restart with the old weights, or an instance still on
     them, refuses them, and the disk tier keeps them in their own folder).

Host logic: no JAX (the runner does the device work).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxserve.engine.pipeline import StepPipeline
from jaxserve.kv import PagePool
from jaxserve.kv.connector import KVConnector
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import KVLayout
from jaxserve.scheduler import Scheduler

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner


class WeightSync:
    """Updates the weights of the pipeline's runner and drops the KV that depends on
    them (its pool's, its connector's, `tier`'s). `relayout` makes the engine's KV
    layout again (None where it has none)."""

    def __init__(
        self,
        pipeline: StepPipeline,
        tier: KVTier | None,
        relayout: Callable[[], KVLayout | None],
    ):
        self.pipeline, self.tier, self.relayout = pipeline, tier, relayout
        self.runner: ModelRunner = pipeline.runner
        self.scheduler: Scheduler = pipeline.scheduler
        self.pool: PagePool = pipeline.pool
        self.connector: KVConnector | None = pipeline.kv_connector

    def update(self, params, path: str | os.PathLike | None, weight_version: int | None) -> int:
        """The steps of the module docstring; returns the new version."""
        return self.install(self.prepare(params, path, weight_version), weight_version)

    def prepare(self, params, path: str | os.PathLike | None, weight_version: int | None) -> list:
        """Step 1: the new weights, converted, checked and placed, not served; raises
        ValueError naming the first mismatch. Any thread."""
        check_update(params, path, weight_version, self.runner.config.model.quantization_config)
        return self.runner.prepare_weights(params, path=None if path is None else os.fspath(path))

    def install(self, new: list, weight_version: int | None) -> int:
        """Steps 2-5 for `prepare`'s weights; returns their version. Between steps, on
        the thread that steps the engine."""
        pipeline = self.pipeline
        pipeline.drain()
        self.runner.swap_weights(new)
        version = pipeline.weight_version + 1 if weight_version is None else weight_version
        pipeline.weight_version = version
        self.scheduler.preempt_all()
        self.drop_cached_kv(self.relayout())
        return version

    def drop_cached_kv(self, layout: KVLayout | None = None) -> None:
        """Forgets every cached page (in use or not) and drops the tier's pages;
        `layout`: the tier's pages are of it from now on (new weights)."""
        self.pool.take_evicted()  # (not copied to the tier: it is cleared)
        if self.connector is not None:
            self.connector.flush()  # a copy in flight lands before the tier is cleared
        self.scheduler.kv.reset_prefix_cache()  # (every layer group's)
        if self.tier is not None:
            self.tier.clear(layout)


def check_update(params, path, weight_version, quantization_config: str | None = None) -> None:
    """Raises ValueError unless exactly one of `params` and `path` is given, and
    `weight_version` is None or an integer; or if the engine serves another tool's
    quantized checkpoint (`ModelConfig.quantization_config`): its codes are read as
    they are, and new weights for them are not served yet."""
    if quantization_config is not None:
        raise ValueError(
            "update_weights: this engine serves a quantized checkpoint's 4-bit codes (or "
            "fp8 weights) as they were read (config.json's quantization_config); new "
            "weights for it are not served yet: serve a float checkpoint (with "
            "quantization='int4' or 'fp8' to have it and its updates quantized)"
        )
    if (params is None) == (path is None):
        raise ValueError(
            "update_weights takes exactly one of params and path, got "
            + ("both" if params is not None else "neither")
        )
    if weight_version is not None and (
        not isinstance(weight_version, int) or isinstance(weight_version, bool)
    ):
        raise ValueError(f"weight_version must be an integer, got {weight_version!r}")


__all__ = ["WeightSync", "check_update"]
