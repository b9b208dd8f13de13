"""The compiled step: a pure function of (model state, KV caches, batch).

The program layout (what is compiled, and for which shapes):

- `forward`: one program per token bucket T. The per-sequence metadata (kv
  lens, page table, query offsets, the rows to sample) always has the fixed size
  S = max_num_seqs, so the sequence count never selects a program. It returns the
  sampled rows' hidden states and every token row's.
- `prompt_logprobs_step`: the LM head over every token row's hidden state, for
  prompt logprobs, one program per token bucket T, dispatched only for a batch
  that asks. (Under a `lax.cond` inside `forward`, XLA would charge every step
  the LM head over T rows and size its temporaries for it.)
- `sample_step`: the LM head and sampling of the B sampled rows, one program per
  row bucket B (and a second per B with the penalty history; on a GPU, where the
  host decides sampling's branches, `input_batch.WARM_BRANCHES`' 6 + 1). A row is a
  sequence's last token, plus one per draft token with speculative decoding
  (R = S * (1 + num_speculative_tokens) rows at most).

So a configuration compiles 2 * len(token buckets) + 2 * len(row buckets) programs
(38 for the defaults, 73 on a GPU; `input_batch.StepShapes` lists the buckets), instead of
one forward per (T, B) pair. With multi-LoRA, each token bucket has a second
forward, with the adapters' terms (`lora_slots` [T]): a step where no token has an
adapter passes no slots ([0]) and runs the first, the base model's, at its cost
(vLLM's `cudagraph_specialize_lora` makes the same split). Speculation with k
drafts adds the row buckets up to S * (1 + k) and a token and row bucket of 1 + k
(a lone speculating sequence).

Asynchronous scheduling needs no program of its own: a step reads the tokens the
host does not have yet from the previous step's sampled ids, an [R] array on the
device (the forward's `prev_tokens`, `sample_step`'s second output).

Each direction of a step is one transfer (`runner.packing`): the forward takes its
batch, and sampling its settings, as one packed int32 buffer each, unpacked inside the
program by static slices; sampling (and prompt logprobs) return one packed vector,
which the host copies back at once and unpacks.

The page tables stay on the device (the forward's `page_table`, donated like the KV
caches): a batch carries its sequences' slots in it and the entries that changed
(`input_batch.PageTable`), so what a step sends does not grow with the context.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import PyTreeDef

from jaxserve.runner.input_batch import NULL_PAGE, HostBatch, SamplingMetadata
from jaxserve.runner.packing import Packed, pack, pack_on_device, unpack
from jaxserve.runner.sampler import sample, token_logprobs
from models.lora import bind_slots
from pallas_kernels import AttentionMetadata, GroupedMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """A step's inputs: all data fields, so only their shapes select a program."""

    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    # Per-sequence arrays of the fixed size S; a hybrid KV cache's, one per layer group.
    attention: AttentionMetadata | GroupedMetadata
    logits_indices: jax.Array  # [R] int32: rows of the hidden states to sample from
    prompt_targets: jax.Array  # [T] int32: next prompt token per row for logprobs; -1 none
    #   (read by `prompt_logprobs_step`, not by `forward`)
    # Asynchronous scheduling: a token row whose id the host does not know yet reads it
    # from the previous step's sampled ids, still on the device (no round trip).
    prev_rows: jax.Array  # [T] int32: the row of `prev_tokens` to read; -1: input_ids
    #   (`prev_tokens` [R] int32, the previous step's sampled ids from `sample_step`, is
    #   the forward's argument beside the batch: it is on the device already)
    # [T] int32: each token row's LoRA adapter slot, 0 none; [0]: no row has an adapter.
    lora_slots: jax.Array
    # The page tables kept on the device (`input_batch.PageTable`; the forward's
    # `page_table` argument [G, slots, M]): each sequence's slot [S], each group's row
    # lengths [G, S], the changed entries [2, W] (flat index, page). Empty when the
    # batch carries the tables whole (`attention`'s page indices).
    table_rows: jax.Array
    table_lens: jax.Array
    table_writes: jax.Array

    @classmethod
    def from_host(cls, b: HostBatch, layer_group: tuple[int, ...] = ()) -> StepInput:
        """`layer_group`: each layer's group, where the batch has several (a hybrid KV
        cache: `ModelRunner.layer_group`)."""
        attention: AttentionMetadata | GroupedMetadata = AttentionMetadata(
            slot_mapping=b.slot_mapping,
            kv_lens=b.kv_lens,
            page_indices=b.page_indices,
            cu_q_lens=b.cu_q_lens,
            num_seqs=b.num_seqs,
        )
        if len(b.group_page_indices):
            if len(set(layer_group)) != 1 + len(b.group_page_indices):
                raise ValueError(
                    f"a batch of {1 + len(b.group_page_indices)} layer groups for layers "
                    f"in groups {layer_group}"
                )
            groups = [attention]
            for slots, table in zip(b.group_slot_mapping, b.group_page_indices, strict=True):
                groups.append(
                    dataclasses.replace(attention, slot_mapping=slots, page_indices=table)
                )
            attention = GroupedMetadata(tuple(groups), tuple(layer_group))
        return cls(
            input_ids=b.input_ids,
            positions=b.positions,
            attention=attention,
            logits_indices=b.logits_indices,
            prompt_targets=b.prompt_targets,
            prev_rows=b.prev_rows,
            lora_slots=b.lora_slots,
            table_rows=b.table_rows,
            table_lens=b.table_lens,
            table_writes=b.table_writes,
        )

    def with_page_table(self, page_table: jax.Array) -> tuple[jax.Array, StepInput]:
        """Device side: the kept page tables with this step's changed entries written,
        and the batch with each sequence's rows gathered from them, cut to the row's
        length (past it the null page, as a table built from the lists has)."""
        index, pages = self.table_writes
        page_table = write_entries(page_table, index, pages)
        width = page_table.shape[-1]
        rows = page_table[:, self.table_rows]  # [G, S, M]
        rows = jnp.where(jnp.arange(width) < self.table_lens[..., None], rows, NULL_PAGE)
        attention = self.attention
        if isinstance(attention, GroupedMetadata):
            groups = tuple(
                dataclasses.replace(g, page_indices=rows[i]) for i, g in enumerate(attention.groups)
            )
            attention = dataclasses.replace(attention, groups=groups)
        else:
            attention = dataclasses.replace(attention, page_indices=rows[0])
        return page_table, dataclasses.replace(self, attention=attention)

    @classmethod
    def packed(cls, b: HostBatch, layer_group: tuple[int, ...] = ()) -> Packed:
        """The batch as one buffer: what a step sends to the device (`runner.packing`)."""
        return pack(cls.from_host(b, layer_group))


class ModelDef:
    """The static half of a split model (its graph and the tree of its weights), the
    key the compiled steps are cached under, so every runner of the same model shares
    them. The hash is computed once: an `nnx.GraphDef` hashes all its nodes on every
    call (~1.5 ms for a 24-layer model, twice a step), and the weights travel as a
    flat list, which JAX flattens in C++ instead of through nnx's Python callbacks.
    """

    def __init__(self, graphdef: nnx.GraphDef, treedef: PyTreeDef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    @classmethod
    def split(cls, model: nnx.Module) -> tuple[ModelDef, list[jax.Array]]:
        """model -> (its ModelDef, its weights as a flat list)."""
        graphdef, state = nnx.split(model)
        weights, treedef = jax.tree.flatten(state)
        return cls(graphdef, treedef), weights

    def state(self, weights: list[jax.Array]) -> nnx.State:
        """The flat weights back in the model's nested state (to look one up by name)."""
        return jax.tree.unflatten(self.treedef, weights)

    def merge(self, weights: list[jax.Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, self.state(weights))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, ModelDef)
            and self._hash == other._hash
            and self.treedef == other.treedef
            and self.graphdef == other.graphdef
        )


def write_entries(page_table: jax.Array, index: jax.Array, pages: jax.Array) -> jax.Array:
    """`page_table` [G, slots, M] with `pages` at the flat `index`es (those past it:
    padding, dropped). Scattered by (group, slot, column), not into a flattened table:
    on a TPU, whose arrays are stored in tiles, a reshape to one dimension and back
    would copy the whole table every step."""
    _, slots, width = page_table.shape
    group, rest = jnp.divmod(index, slots * width)
    slot, column = jnp.divmod(rest, width)
    return page_table.at[group, slot, column].set(pages, mode="drop")


def _forward(
    model_def: ModelDef,
    weights: list[jax.Array],
    kv_caches: list[jax.Array],
    packed: Packed,
    prev_tokens: jax.Array,
    page_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, list[jax.Array], jax.Array | None]:
    """One forward pass of the batch (a packed `StepInput`) -> the hidden states of the
    rows to sample [R, D], those of every token row [T, D] (for
    `prompt_logprobs_step`), the updated KV caches and page tables. `prev_tokens` [R]:
    the previous step's sampled ids (asynchronous scheduling; zeros when none is in
    flight). `page_table` [G, slots, M]: the page tables kept on the device, of which
    the batch carries the changes (`StepInput.with_page_table`); None: the batch
    carries them whole (the draft model's steps).

    The KV caches and page tables are donated: XLA updates them in place, and the
    caller must use the returned ones from then on. The sampled rows' LM head is left
    to `sample_step`, which depends on B alone, so that a program per token bucket
    serves every sequence count.
    """
    batch: StepInput = unpack(packed)
    if page_table is not None:
        page_table, batch = batch.with_page_table(page_table)
    model = model_def.merge(weights)
    if batch.lora_slots.shape[0]:  # (else no token has an adapter: the base model's program)
        bind_slots(model, batch.lora_slots)
    prev = prev_tokens[jnp.maximum(batch.prev_rows, 0)]
    input_ids = jnp.where(batch.prev_rows >= 0, prev, batch.input_ids)
    hidden, kv_caches = model(kv_caches, input_ids, batch.positions, batch.attention)
    return hidden[batch.logits_indices], hidden, kv_caches, page_table


def _prompt_logprobs(
    model_def: ModelDef,
    weights: list[jax.Array],
    hidden: jax.Array,
    targets: jax.Array,
    logprobs_mode: str = "raw_logprobs",
) -> jax.Array:
    """Every token row's hidden state [T, D] and its next prompt token [T] (-1: none)
    -> (the target's logprob and rank, top ids, top logprobs) per row, packed in one vector
    (`prompt_logprobs_layout(T)`).

    As vLLM's: `*_logits` modes give the logits, `*_logprobs` modes their log_softmax,
    of the model's raw distribution in the processed modes too. No sampling
    processing exists at a prompt position: penalties, the bitmask and temperature
    belong to drawing a token, and no token is drawn there."""
    logits = model_def.merge(weights).compute_logits(hidden)
    as_logits = logprobs_mode.endswith("logits")
    return pack_on_device(token_logprobs(logits, jnp.maximum(targets, 0), as_logits=as_logits))


def _logits(model_def: ModelDef, weights: list[jax.Array], hidden: jax.Array) -> jax.Array:
    """[B, D] -> logits [B, V] float32."""
    return model_def.merge(weights).compute_logits(hidden)


def _sample(
    model_def: ModelDef,
    weights: list[jax.Array],
    selected: jax.Array,
    packed: Packed,
    prev_tokens: jax.Array,
    logprobs_mode: str = "raw_logprobs",
) -> tuple[jax.Array, jax.Array]:
    """The first B rows of `selected` [R, D] (B from the packed `SamplingMetadata`) ->
    one sampled token per row (logits never leave the device), as a packed
    `SamplerOutput` (one vector: one copy to the host, `SamplerOutput.layout(B)`), and
    the sampled ids padded to [R]: the next step's `prev_tokens` under asynchronous
    scheduling (one shape whatever B, so it selects no forward program).

    `prev_tokens` [R]: the previous step's, for the history's tokens in flight.
    `logprobs_mode`: the engine's (static: bound at construction, `StepPrograms.place`)."""
    sampling: SamplingMetadata = unpack(packed)
    rows, b = selected.shape[0], sampling.temperature.shape[0]
    history = sampling.history  # ids <= -2: -2 - (a row of prev_tokens)
    in_flight = prev_tokens[jnp.clip(-2 - history, 0, rows - 1)]
    sampling = dataclasses.replace(sampling, history=jnp.where(history <= -2, in_flight, history))
    out = sample(model_def.merge(weights).compute_logits(selected[:b]), sampling, logprobs_mode)
    return pack_on_device(out), jnp.pad(out.token_ids, (0, rows - b))


# Unsharded (one device): the shardings follow the arguments. Weights and KV caches
# are uncommitted there (loaded with jnp.asarray), as warm-up's abstract arguments
# are: a committed argument would be another jit cache entry, compiled again.
forward = jax.jit(_forward, static_argnums=0, donate_argnums=(2, 5))
table_writes = jax.jit(write_entries, donate_argnums=0)  # (entries past a step's own)
logits_step = jax.jit(_logits, static_argnums=0)
sample_step = jax.jit(_sample, static_argnums=0)
prompt_logprobs_step = jax.jit(_prompt_logprobs, static_argnums=0)


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The step functions jitted for one placement of the weights and KV caches, and
    one `logprobs_mode` (bound into the sampling and prompt-logprob functions, so an
    engine compiles its programs once, for its own mode).

    On a mesh every program states its shardings: weights and KV caches as placed
    (`jaxserve.distributed.meshes`), the KV caches out exactly as in (so donation updates them
    in place, step after step), and everything else replicated: the kept page tables
    and the host's batch arrays in (they are small), the hidden rows, logits and
    sampled tokens out (sampling runs on the devices; only ids cross to the host).
    """

    forward: Callable
    logits_step: Callable
    sample_step: Callable
    prompt_logprobs: Callable
    table_writes: Callable  # (page_table, index, pages): the entries past a step's own

    @classmethod
    def place(
        cls,
        mesh: Mesh | None,
        weights: list[jax.Array],
        kv_caches: list[jax.Array],
        logprobs_mode: str = "raw_logprobs",
    ) -> StepPrograms:
        if mesh is None:
            return unsharded(logprobs_mode)
        rep = NamedSharding(mesh, PartitionSpec())
        sample_fn = functools.partial(_sample, logprobs_mode=logprobs_mode)
        prompt_fn = functools.partial(_prompt_logprobs, logprobs_mode=logprobs_mode)
        w = [x.sharding for x in weights]
        kv = jax.tree.map(lambda x: x.sharding, kv_caches)  # (a QuantizedKV: both parts)
        return cls(
            forward=jax.jit(
                _forward,
                static_argnums=0,
                donate_argnums=(2, 5),
                in_shardings=(w, kv, rep, rep, rep),
                out_shardings=(rep, rep, kv, rep),
            ),
            logits_step=jax.jit(
                _logits, static_argnums=0, in_shardings=(w, rep), out_shardings=rep
            ),
            sample_step=jax.jit(
                sample_fn, static_argnums=0, in_shardings=(w, rep, rep, rep), out_shardings=rep
            ),
            prompt_logprobs=jax.jit(
                prompt_fn, static_argnums=0, in_shardings=(w, rep, rep), out_shardings=rep
            ),
            table_writes=jax.jit(write_entries, donate_argnums=0, out_shardings=rep),
        )


UNSHARDED = StepPrograms(forward, logits_step, sample_step, prompt_logprobs_step, table_writes)


@functools.cache
def unsharded(logprobs_mode: str) -> StepPrograms:
    """The one-device programs of a mode: made once per process, so every runner in
    it of that mode shares their jit caches (as `UNSHARDED`'s, the default mode's)."""
    if logprobs_mode == "raw_logprobs":
        return UNSHARDED
    return dataclasses.replace(
        UNSHARDED,
        sample_step=jax.jit(
            functools.partial(_sample, logprobs_mode=logprobs_mode), static_argnums=0
        ),
        prompt_logprobs=jax.jit(
            functools.partial(_prompt_logprobs, logprobs_mode=logprobs_mode), static_argnums=0
        ),
    )
