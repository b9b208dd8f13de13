"""The per-step attention metadata, a pytree whose fields are all traced."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """A ragged batch's layout (see `ragged_paged_attention` for the conventions).

    Every field is a data field: changing values never recompiles; only the
    shapes (the token bucket T, the sequence bucket B, the page-table width M)
    select a compiled program.
    """

    slot_mapping: jax.Array  # [T] int32: where each token's K/V goes (page * S + offset)
    kv_lens: jax.Array  # [B] int32: kv length of each sequence after this step
    page_indices: jax.Array  # [B, M] int32: the page table
    cu_q_lens: jax.Array  # [B + 1] int32: cumulative query tokens per sequence
    num_seqs: jax.Array  # [1] int32: sequences that are not padding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedMetadata:
    """A hybrid KV cache's metadata: one `AttentionMetadata` per layer group (each
    group's own page table and slot mapping; kv lens and query offsets alike), and
    which group each layer reads (static: a model's grouping is fixed, so it never
    recompiles). Each layer is handed its group's metadata (`for_layer`), so the
    kernels read one page table as ever."""

    groups: tuple[AttentionMetadata, ...]
    layer_group: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # [L]

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.layer_group[layer]]


def layer_metadata(md, layer: int):
    """The metadata layer `layer` attends with: its group's, where `md` is grouped;
    else `md` itself (one group, or a backend's own kind of metadata)."""
    return md.for_layer(layer) if isinstance(md, GroupedMetadata) else md
