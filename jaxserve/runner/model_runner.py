"""The model runner: owns the weights, the KV caches and the compiled step."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve import parallel
from jaxserve.checkpoint import load_model
from jaxserve.config import EngineConfig
from jaxserve.runner.input_batch import HostBatch, SeqWork, build_batch, pick_bucket, pow2_buckets
from jaxserve.runner.step import StepInput, make_step

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs steps of ragged batches against one pre-allocated paged KV cache."""

    def __init__(self, config: EngineConfig, mesh: Mesh | None = None):
        self.config = config
        t0 = time.perf_counter()
        model = load_model(
            config.model_dir,
            config.model,
            dtype=config.dtype,
            attention_backend=config.attention_backend,
            mesh=mesh,
        )
        self.graphdef, self.state = nnx.split(model)
        self.num_pages = config.num_kv_pages()
        self.kv_caches = self._allocate_kv(mesh)
        self._step = make_step(self.graphdef)
        self.token_buckets = pow2_buckets(16, config.max_num_batched_tokens)
        self.seq_buckets = pow2_buckets(1, config.max_num_seqs)
        m, page = config.model, config.cache.page_size
        kv_tokens = (self.num_pages - 1) * page
        logger.info(
            "loaded %s (%s) in %.1fs; KV cache: %d pages x %d tokens = %d tokens (%.1f MiB), "
            "maximum concurrency at max_model_len %d: %.2fx",
            m.architecture,
            config.dtype,
            time.perf_counter() - t0,
            self.num_pages - 1,
            page,
            kv_tokens,
            self.num_pages * config.kv_bytes_per_page() / 2**20,
            config.max_model_len,
            kv_tokens / config.max_model_len,
        )

    def _allocate_kv(self, mesh: Mesh | None) -> list[jax.Array]:
        m = self.config.model
        shape = (self.num_pages, self.config.cache.page_size, 2 * m.num_kv_heads, m.head_dim)
        dtype = jnp.dtype(self.config.kv_dtype)
        if mesh is None:
            return [jnp.zeros(shape, dtype) for _ in range(m.num_layers)]
        sharding = parallel.kv_cache_sharding(mesh, m.num_kv_heads)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return [zeros() for _ in range(m.num_layers)]

    def build(self, work: list[SeqWork], *, all_logits: bool = False) -> HostBatch:
        num_tokens = sum(len(w.token_ids) for w in work)
        return build_batch(
            work,
            page_size=self.config.cache.page_size,
            pages_per_seq=self.config.pages_per_seq,
            token_bucket=pick_bucket(num_tokens, self.token_buckets, what="tokens"),
            seq_bucket=pick_bucket(len(work), self.seq_buckets, what="sequences"),
            all_logits=all_logits,
        )

    def execute(self, batch: HostBatch) -> jax.Array:
        """Runs one step; returns logits [B, V] (float32, on device)."""
        logits, self.kv_caches = self._step(self.state, self.kv_caches, StepInput.from_host(batch))
        return logits
