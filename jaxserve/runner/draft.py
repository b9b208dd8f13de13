"""The draft model of speculative decoding: a small model proposes k tokens.

The draft shares the target's page tables: its own KV arrays (one per draft
layer) have the target's page count and page size, so a sequence's pages hold
the target's K/V in the target's arrays and the draft's in the draft's, and no
second allocator exists. Its bookkeeping is one number per sequence,
`SequenceState.draft_computed`: the tokens whose draft K/V are in the pages.

Each step, before the target verifies, the draft catches up on the tokens it
has not seen (a prompt the first time, the last accepted draft after a fully
accepted run; `forward` with the draft's weights, in chunks of the step budget),
then proposes in one program: k single-token steps in a `lax.fori_loop`, each
feeding the token the previous one chose (greedy: the proposals are
deterministic, so the sampler's rejection rule for one-hot proposals keeps the
output distribution exact). After verification `draft_computed` moves back to
the tokens the target accepted; what the draft wrote past them is overwritten
the next time those positions are fed. A sequence starts (and restarts after a
preemption) with `draft_computed` 0, so the draft recomputes even a prefix the
target found cached (writing the same values into the shared pages): the
catch-up is a prefill of the draft model, not yet counted against the step's
token budget. Whatever the draft's K/V, verification keeps outputs exact; only
acceptance depends on it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.checkpoint import load_model
from jaxserve.config import EngineConfig
from jaxserve.distributed import meshes
from jaxserve.runner import bundle
from jaxserve.runner.input_batch import SeqWork, StepShapes, build_batch, pick_bucket
from jaxserve.runner.sampler import argmax
from jaxserve.runner.step import ModelDef, StepInput, StepPrograms
from jaxserve.sequence import SequenceState
from models.layers import without_cpu_kernels
from pallas_kernels import AttentionMetadata

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProposeInput:
    """The proposing sequences, packed first: [S] unless noted."""

    last_token: jax.Array  # i32: each sequence's last known token
    position: jax.Array  # i32: its position
    steps: jax.Array  # i32: tokens to propose (0 for padding rows)
    page_indices: jax.Array  # [S, M] i32
    num_seqs: jax.Array  # [1] i32


def _propose(
    model_def: ModelDef,
    weights: list[jax.Array],
    kv_caches: list[jax.Array],
    inp: ProposeInput,
    k: int,
) -> tuple[jax.Array, list[jax.Array]]:
    """k greedy single-token steps of the draft -> proposals [S, k], updated caches.

    Step j feeds each sequence's token at position `position + j` (its last known
    token, then its own proposals) and writes its K/V there; rows past a
    sequence's `steps` write to the null page (slot 0) and are ignored.
    """
    model = model_def.merge(weights)
    s, m = inp.page_indices.shape
    page = kv_caches[0].shape[1]
    rows = jnp.arange(s)
    cu_q_lens = jnp.minimum(jnp.arange(s + 1), inp.num_seqs[0]).astype(jnp.int32)

    def one(j, carry):
        tokens, caches, out = carry
        live = (j < inp.steps) & (rows < inp.num_seqs[0])
        # A row past its steps re-reads its last known position and writes nowhere.
        pos = jnp.where(live, inp.position + j, inp.position)
        page_of = inp.page_indices[rows, jnp.minimum(pos // page, m - 1)]
        md = AttentionMetadata(
            slot_mapping=jnp.where(live, page_of * page + pos % page, 0).astype(jnp.int32),
            kv_lens=jnp.where(rows < inp.num_seqs[0], pos + 1, 0).astype(jnp.int32),
            page_indices=inp.page_indices,
            cu_q_lens=cu_q_lens,
            num_seqs=inp.num_seqs,
        )
        hidden, caches = model(caches, tokens, pos, md)
        nxt = argmax(model.compute_logits(hidden))
        return nxt, caches, out.at[:, j].set(nxt)

    out = jnp.zeros((s, k), jnp.int32)
    _, kv_caches, out = lax.fori_loop(0, k, one, (inp.last_token, kv_caches, out))
    return out, kv_caches


propose_step = jax.jit(_propose, static_argnums=(0, 4), donate_argnums=2)


def place_propose_step(mesh: Mesh | None, weights, kv_caches):
    """`propose_step` with explicit shardings on a mesh (as `StepPrograms.place`)."""
    if mesh is None:
        return propose_step
    rep = NamedSharding(mesh, PartitionSpec())
    kv = jax.tree.map(lambda x: x.sharding, kv_caches)  # (a QuantizedKV: both parts)
    return jax.jit(
        _propose,
        static_argnums=(0, 4),
        donate_argnums=2,
        in_shardings=([x.sharding for x in weights], kv, rep),
        out_shardings=(rep, kv),
    )


def load_draft(
    config: EngineConfig, mesh: Mesh | None, compile_only: jax.Device | None = None
) -> nnx.Module:
    """The draft model of `config.speculative`, placed on `mesh` (shapes only for a
    `compile_only` device). Loaded before the KV pool is sized, which leaves it room."""
    spec = config.speculative
    t0 = time.perf_counter()
    model = load_model(
        spec.model,
        spec.draft,
        dtype=config.dtype,
        attention_backend=config.attention_backend,
        mesh=mesh,
        quantization=config.quantization,
        compile_only=compile_only,
    )
    logger.info("draft model %s loaded in %.1fs", spec.model, time.perf_counter() - t0)
    return model if config.native_cpu_kernels else without_cpu_kernels(model)


class DraftRunner:
    """Owns the draft model's weights and KV arrays; proposes tokens for sequences."""

    def __init__(
        self,
        config: EngineConfig,
        model: nnx.Module,
        *,
        num_pages: int,
        shapes: StepShapes,
        compiles,
        mesh: Mesh | None = None,
        compile_only: jax.Device | None = None,
    ):
        """`model`: the draft model, loaded (`load_draft`) on `mesh`, the target's;
        the draft is sharded over it the same way. `compile_only`: the target model
        runner's compile-only device (see `ModelRunner`): shapes instead of weights
        and KV caches."""
        spec = config.speculative
        self.config, self.k, self.shapes, self.compiles = (
            config,
            spec.num_speculative_tokens,
            shapes,
            compiles,
        )
        draft_config = spec.draft  # its vocabulary checked against the target's there
        self.mesh = mesh
        self.model_def, self.weights = ModelDef.split(model)
        layout = config.cache_layout(
            draft_config, meshes.kv_shards(mesh, draft_config.num_kv_heads)
        )
        make_kv = meshes.zeros_kv if compile_only is None else meshes.abstract_kv
        where = (mesh,) if compile_only is None else (mesh, compile_only)
        self.kv_caches = make_kv(
            *where, draft_config.num_layers, layout, num_pages, config.kv_dtype
        )
        self.programs = StepPrograms.place(mesh, self.weights, self.kv_caches)
        # Its forward's `prev_tokens`: none (the target's steps carry the tokens in flight).
        self.no_prev_tokens = meshes.no_prev_tokens(mesh, shapes.max_rows, compile_only is not None)
        self.propose_step = place_propose_step(mesh, self.weights, self.kv_caches)
        logger.info(
            "draft model %s (%s, %d layers): weights %.1f MiB, its KV %.1f MiB on the "
            "target's page tables",
            spec.model,
            draft_config.architecture,
            draft_config.num_layers,
            meshes.total_bytes(self.weights) / 2**20,
            meshes.total_bytes(self.kv_caches) / 2**20,
        )
        self.warmed_up = False

    # ------------------------------------------------------------- proposing

    def propose(self, wanted: list[tuple[SequenceState, int]]) -> list[list[int]]:
        """For each (decoding sequence, n), n proposed tokens to follow its tokens.

        Pages must cover the sequence's tokens plus n (the scheduler grew them)."""
        before = self.compiles.count
        self._catch_up([seq for seq, _ in wanted])
        s = self.shapes.max_seqs
        m = self.config.pages_per_seq
        last = np.zeros(s, np.int32)
        position = np.zeros(s, np.int32)
        steps = np.zeros(s, np.int32)
        page_indices = np.zeros((s, m), np.int32)
        for i, (seq, n) in enumerate(wanted):
            last[i], position[i], steps[i] = seq.token_ids[-1], seq.num_tokens - 1, n
            page_indices[i, : len(seq.pages)] = seq.pages
        inp = ProposeInput(last, position, steps, page_indices, np.array([len(wanted)], np.int32))
        with meshes.on_mesh(self.mesh):
            out, self.kv_caches = self.propose_step(
                self.model_def, self.weights, self.kv_caches, inp, self.k
            )
        self._check_compiles(before)
        out = np.asarray(out)
        for seq, n in wanted:
            seq.draft_computed = seq.num_tokens - 1 + n
        return [out[i, :n].tolist() for i, (_, n) in enumerate(wanted)]

    def _catch_up(self, seqs: list[SequenceState]) -> None:
        """Feeds the draft every token but the last that it has not seen, in chunks
        of at most the step budget."""
        budget = self.config.scheduler.max_num_batched_tokens
        todo = [seq for seq in seqs if seq.draft_computed < seq.num_tokens - 1]
        while todo:
            work, left = [], budget
            for seq in todo:
                if left == 0:
                    break
                n = min(seq.num_tokens - 1 - seq.draft_computed, left)
                start = seq.draft_computed
                work.append(SeqWork(seq.token_ids[start : start + n], start, seq.pages))
                seq.draft_computed += n
                left -= n
            batch = build_batch(
                work,
                page_size=self.config.cache.page_size,
                pages_per_seq=self.config.pages_per_seq,
                token_bucket=pick_bucket(budget - left, self.shapes.token_buckets, what="tokens"),
                seq_bucket=self.shapes.max_seqs,
                num_rows=self.shapes.max_rows,
            )
            with meshes.on_mesh(self.mesh):
                _, _, self.kv_caches, _ = self.programs.forward(
                    self.model_def,
                    self.weights,
                    self.kv_caches,
                    StepInput.packed(batch),
                    self.no_prev_tokens,
                    None,  # (its batches carry the page tables whole)
                )
            todo = [seq for seq in todo if seq.draft_computed < seq.num_tokens - 1]

    def close(self) -> None:
        """Drops the draft model's device buffers and programs (the target's runner
        closes the shared compile counter); it proposes nothing after it."""
        self.weights = self.kv_caches = self.no_prev_tokens = None
        self.programs = self.propose_step = None

    def _check_compiles(self, before: int) -> None:
        if self.warmed_up and self.config.compile_guard and self.compiles.count != before:
            raise RuntimeError("a draft-model step compiled after warm-up")

    # ---------------------------------------------------------------- warm-up

    def use_compiled(self, compiled: dict) -> None:
        """Steps with a compiled bundle's draft programs (`ModelRunner.load_compiled`)."""
        self.programs = bundle.step_programs(compiled, self.programs, "draft ", sampling=False)
        self.propose_step = bundle.by_shape(compiled, "draft propose k=", static_argnums=(0, 4))
        self.warmed_up = True

    def lower_all(self, abstract) -> list[tuple[str, jax.stages.Lowered]]:
        """The draft's programs, lowered from abstract shapes (`abstract(tree)` turns
        numpy arrays into ShapeDtypeStructs): a forward per token bucket, the proposer."""
        with meshes.on_mesh(self.mesh):
            return self._lower_all(abstract)

    def _lower_all(self, abstract) -> list[tuple[str, jax.stages.Lowered]]:
        lowered = []
        for t in self.shapes.token_buckets:
            batch = build_batch(
                [],
                page_size=self.config.cache.page_size,
                pages_per_seq=self.config.pages_per_seq,
                token_bucket=t,
                seq_bucket=self.shapes.max_seqs,
                num_rows=self.shapes.max_rows,
            )
            program = self.programs.forward.lower(
                self.model_def,
                self.weights,
                self.kv_caches,
                abstract(StepInput.packed(batch)),
                self.no_prev_tokens,  # (as it is: its placement is part of the jit key)
                None,
            )
            lowered.append((f"draft forward T={t}", program))
        program = self.propose_step.lower(*self.propose_args(abstract))
        lowered.append((f"draft propose k={self.k}", program))
        return lowered

    def propose_args(self, abstract) -> tuple:
        """The proposer's arguments for warm-up (and `jaxserve.preflight`), its batch
        abstract: (model, weights, KV caches, input, k)."""
        s, m = self.shapes.max_seqs, self.config.pages_per_seq
        zeros = np.zeros(s, np.int32)
        inp = ProposeInput(zeros, zeros, zeros, np.zeros((s, m), np.int32), np.zeros(1, np.int32))
        return self.model_def, self.weights, self.kv_caches, abstract(inp), self.k
