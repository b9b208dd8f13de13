"""The device side of LoRA serving: the model's projections wrapped with slot-stacked
adapter matrices (`models.lora`), placed like the weights, and one program that
writes an adapter into a slot.

The matrices are entries of the runner's flat weights list (`LoRAWeights` knows
which), so the step programs take them as they take the weights, and writing a slot
replaces those entries with the program's outputs: the old arrays are donated
(written in place), and since every shape is fixed (every projection is written,
the ones an adapter does not adapt with zeros; ranks padded to max_lora_rank), the
write compiles once, at warm-up, whatever adapter goes into whichever slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig
from jaxserve.distributed import meshes
from jaxserve.lora.peft import Adapter, LoRALayout, module_key
from jaxserve.runner.bundle import by_shape
from jaxserve.runner.step import ModelDef
from models.lora import LoRAWeight, add_lora

PROGRAM = "lora slot write"


def add_adapters(model: nnx.Module, config: EngineConfig, mesh: Mesh | None, compile_device):
    """`model` with its projections wrapped for `config.lora` (`models.lora.add_lora`),
    the new matrices zeros placed as their base layers are (on one device:
    uncommitted, as the weights; for a compile-only device: ShapeDtypeStructs)."""
    lora = config.lora
    abstract = compile_device is not None
    add_lora(
        model,
        num_slots=lora.max_loras,
        rank=lora.max_lora_rank,
        abstract=abstract,
        dtype=jnp.dtype(config.dtype),
    )
    if mesh is None and not abstract:
        return model
    state = nnx.state(model, LoRAWeight)
    if abstract:
        placed = meshes.abstract_state(state, mesh, compile_device)
    else:
        placed = jax.device_put(state, meshes.state_shardings(state, mesh))
    nnx.update(model, placed)
    return model


def _write(arrays: list[jax.Array], slot: jax.Array, values: list[jax.Array]) -> list[jax.Array]:
    """Each stacked matrix [S + 1, ...] with `values[i]` written at index `slot`."""
    return [
        jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), slot, 0)
        for a, v in zip(arrays, values, strict=True)
    ]


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str  # `module_key`: 'layers.0.self_attn.q_proj'
    a: int  # index of lora_a [S + 1, r, in] in the weights list
    b: int  # index of lora_b [S + 1, r, out]
    d_in: int
    d_out: int


class LoRAWeights:
    """Where the LoRA matrices are in a runner's weights list, and their slot write."""

    def __init__(self, model_def: ModelDef, weights: list, mesh: Mesh | None, config: EngineConfig):
        found: dict[str, dict[str, int]] = {}
        paths = jax.tree_util.tree_flatten_with_path(model_def.state(weights))[0]
        for i, (path, _) in enumerate(paths):
            names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            if names and names[-1] == "value":  # (an nnx Variable's array)
                names.pop()
            if names and names[-1] in ("lora_a", "lora_b"):
                found.setdefault(".".join(names[:-1]), {})[names[-1]] = i
        self.entries = []
        for path, ab in found.items():
            a, b = weights[ab["lora_a"]], weights[ab["lora_b"]]
            key = module_key(path)
            if key is None:
                raise ValueError(f"LoRA projection {path} is outside the decoder layers")
            self.entries.append(_Entry(key, ab["lora_a"], ab["lora_b"], a.shape[2], b.shape[2]))
        self.indices = [i for e in self.entries for i in (e.a, e.b)]
        self.rank = config.lora.max_lora_rank
        self.num_slots = config.lora.max_loras
        self._zeros: dict[tuple, np.ndarray] = {}
        if mesh is None:
            self.program: Callable = jax.jit(_write, donate_argnums=0)
        else:
            shardings = [weights[i].sharding for i in self.indices]
            rep = NamedSharding(mesh, PartitionSpec())
            self.program = jax.jit(
                _write,
                donate_argnums=0,
                in_shardings=(shardings, rep, rep),
                out_shardings=shardings,
            )

    def layout(self) -> LoRALayout:
        """What adapters this model can take (for `jaxserve.lora.load_adapter`)."""
        return LoRALayout({e.name: (e.d_in, e.d_out) for e in self.entries}, self.rank)

    def is_lora(self) -> Callable[[int], bool]:
        """Whether an index of the weights list is a LoRA matrix."""
        indices = frozenset(self.indices)
        return indices.__contains__

    def _values(self, adapter: Adapter | None) -> list[np.ndarray]:
        """Every matrix of one slot, float32, padded to the rank: the adapter's, zeros
        where it adapts nothing (None: all zeros, an empty slot). The write casts them
        on the device (numpy's bfloat16 cast took most of a write's time)."""
        out = []
        for e in self.entries:
            pair = adapter.weights.get(e.name) if adapter is not None else None
            a_pad = self._zero((self.rank, e.d_in))
            b_pad = self._zero((self.rank, e.d_out))
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                a_pad, b_pad = a_pad.copy(), b_pad.copy()
                a_pad[:r], b_pad[:r] = a, b
            out += [a_pad, b_pad]
        return out

    def _zero(self, shape: tuple[int, int]) -> np.ndarray:
        if shape not in self._zeros:
            self._zeros[shape] = np.zeros(shape, np.float32)
        return self._zeros[shape]

    def write(self, weights: list, slot: int, adapter: Adapter | None) -> list:
        """`weights` with `adapter` written into `slot` (the old matrices donated)."""
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"LoRA slot {slot} is not in [1, {self.num_slots}]")
        arrays = [weights[i] for i in self.indices]
        new = self.program(arrays, np.int32(slot), self._values(adapter))
        weights = list(weights)
        for i, x in zip(self.indices, new, strict=True):
            weights[i] = x
        return weights

    def lower(self, weights: list, abstract) -> list[tuple[str, jax.stages.Lowered]]:
        """The slot write, lowered for warm-up (`abstract(tree)`: shapes of a tree)."""
        arrays = [weights[i] for i in self.indices]
        values = abstract(self._values(None))
        slot = jax.ShapeDtypeStruct((), jnp.int32)
        return [(PROGRAM, self.program.lower(arrays, slot, values))]

    def use_compiled(self, compiled: dict) -> None:
        """Writes with a bundle's program from now on (`jaxserve.runner.bundle`)."""
        self.program = by_shape(compiled, PROGRAM, key_argnums=(0,))
