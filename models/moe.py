"""The mixture-of-experts MLP shared by Mixtral, Qwen3-MoE, Qwen2-MoE and DeepSeek:
routers, stacked experts, and the grouped expert computation beside its dense reference.

Glossary (with `pallas_kernels`' T tokens, D model dim): E experts, k experts per
token, I an expert's hidden size, A = T * k token-expert assignments, m rows in
one tile of the tiled grouped matmul.

The experts run on tokens grouped by expert: the A assignments are sorted by
expert so that each expert's rows are one contiguous group, a grouped matmul
multiplies group e by expert e's weights, and the rows are unsorted and summed
per token with the router's weights. Two grouped matmuls, the same contract:

- "ragged_dot": `lax.ragged_dot`. On TPU and GPU it lowers to XLA's native
  ragged dot (`chlo.ragged_dot`); on the CPU JAX decomposes it into a masked
  dense dot over all E experts (E times the work, every expert's weights read),
  so it is not used there.
- "tiles": a loop over tiles of m sorted rows, each tile inside one expert's
  group, each multiplied by its own expert's weights (a dynamic slice): only the
  experts that have tokens are read, and an expert with no tokens costs nothing.
  The CPU default.

"dense" (`moe_dense`, every expert on every token) is the reference the tests
hold both to, and the benchmark's baseline. "auto" picks "tiles" on the CPU and
"ragged_dot" elsewhere, when the layer is traced.

Expert parallelism: `jaxserve.distributed.meshes` shards the stacked experts over the
mesh's 'model' axis (E / n experts a device). When the step is traced under that
mesh (`jax.set_mesh`), the grouped computation runs in a `shard_map` over
'model': every device routes and sorts all tokens (they are replicated there, as
after any tensor-parallel layer), runs only its own experts' groups, and one
psum of the [T, D] outputs adds the devices' parts. Without a mesh in context
XLA's partitioner handles the sharded weights by itself (same results, no EP
schedule).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.int4 import INT4_GROUP_SIZE, int4_group_size
from models.layers import ACTIVATIONS, INIT, _axes, _param, dot_f32, linear
from pallas_kernels.quantization import quantize


def route(
    router_logits: jax.Array,  # [T, E]
    top_k: int,
    *,
    norm_topk_prob: bool,
) -> tuple[jax.Array, jax.Array]:  # expert ids [T, k] int32, weights [T, k] float32
    """Softmax over all experts, then the top k (ties: the lower expert id first);
    with `norm_topk_prob` the k weights are renormalised to sum to one."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def route_grouped(
    router_logits: jax.Array,  # [T, E] float32
    top_k: int,
    *,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    correction_bias: jax.Array | None = None,  # [E] (noaux_tc)
) -> tuple[jax.Array, jax.Array]:  # expert ids [T, k] int32, weights [T, k] float32
    """DeepSeek's routers, as transformers computes them (`MoeConfig.topk_method`):

    - "greedy" (V2): the top k of the softmax;
    - "group_limited_greedy" (V2): the experts of the `topk_group` groups with the
      highest best softmax score, then the top k of those;
    - "noaux_tc" (V3): sigmoid scores; the choice (groups by the sum of their two
      best, then experts) is made on the scores plus `correction_bias`, the weights
      are the unbiased scores, renormalised with `norm_topk_prob`.

    Then times `routed_scaling_factor`. Ties go to the lower index (torch's topk is
    unordered there).
    """
    t, num_experts = router_logits.shape
    logits = router_logits.astype(jnp.float32)
    if topk_method == "noaux_tc":
        scores = jax.nn.sigmoid(logits)
        choice = scores + correction_bias.astype(jnp.float32)
    else:
        scores = choice = jax.nn.softmax(logits, axis=-1)
    if topk_method != "greedy":
        grouped = choice.reshape(t, n_group, num_experts // n_group)
        if topk_method == "noaux_tc":
            group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
        else:
            group_scores = jnp.max(grouped, axis=-1)
        _, groups = lax.top_k(group_scores, topk_group)  # [T, topk_group]
        keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], groups].set(True)
        keep = jnp.repeat(keep, num_experts // n_group, axis=-1)  # [T, E]
        # transformers masks V3's choice with -inf and V2's scores with 0.
        choice = jnp.where(keep, choice, -jnp.inf if topk_method == "noaux_tc" else 0.0)
    _, ids = lax.top_k(choice, top_k)
    # V3 weighs by the unbiased scores; V2 by the scores it chose on.
    weights = jnp.take_along_axis(scores if topk_method == "noaux_tc" else choice, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * routed_scaling_factor


# ----------------------------------------------------------------------------
# Grouped matmuls: lhs [A, K] sorted by group, rhs [E, K, N], group_sizes [E]
# (summing to A) -> [A, N] float32, row r multiplied by its group's matrix.
# ----------------------------------------------------------------------------


# `first_group`: rhs holds groups first_group .. first_group + rhs.shape[0] - 1 of the
# E in group_sizes (one device's experts); rows of the other groups come out zero.


class Int4Stack(NamedTuple):
    """One projection of E experts in 4 bits (`Int4Experts`), in the float experts'
    orientation: codes [E, K, N] int4 (K inputs, N outputs), a scale [E, K / G, N] per
    (expert, group of G inputs, output) in the compute dtype; symmetric (no zero
    points), as on-the-fly int4 quantizes. A grouped matmul takes it for `rhs`."""

    codes: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.codes.shape

    def dequantize(self) -> jax.Array:  # [E, K, N] in the scale's dtype
        e, k, n = self.codes.shape
        groups = self.scale.shape[1]
        w = self.codes.astype(self.scale.dtype).reshape(e, groups, k // groups, n)
        return (w * self.scale[:, :, None, :]).reshape(e, k, n)


def dequantized(w: jax.Array | Int4Stack) -> jax.Array:
    """A projection's stacked matrices [E, K, N] as floats (4-bit ones dequantized)."""
    return w.dequantize() if isinstance(w, Int4Stack) else w


def gmm_ragged_dot(
    lhs: jax.Array, rhs: jax.Array | Int4Stack, group_sizes: jax.Array, first_group=0
) -> jax.Array:
    # 4-bit experts: dequantized whole, then XLA's ragged dot (a first form: it writes
    # the float weights out; the codes into the dot itself would read a quarter).
    rhs = dequantized(rhs)
    num_local = rhs.shape[0]
    if num_local == group_sizes.shape[0]:
        return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    # Rows before and after this device's groups: two extra groups with zero matrices.
    local = lax.dynamic_slice_in_dim(group_sizes, first_group, num_local)
    before = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < first_group, group_sizes, 0))
    after = lhs.shape[0] - before - jnp.sum(local)
    sizes = jnp.concatenate([before[None], local, after[None]]).astype(jnp.int32)
    zero = jnp.zeros((1, *rhs.shape[1:]), rhs.dtype)
    rhs = jnp.concatenate([zero, rhs, zero])
    return lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)


def tile_rows(num_rows: int, num_groups: int) -> int:
    """m: about the rows an expert gets on average (A / E), a power of two in [8, 128],
    so a used expert takes one or two tiles and padding stays small."""
    per_group = max(1, num_rows // num_groups)
    return min(128, max(8, 1 << (per_group - 1).bit_length()))


def gmm_tiles(
    lhs: jax.Array, rhs: jax.Array | Int4Stack, group_sizes: jax.Array, first_group=0
) -> jax.Array:
    """The grouped matmul as a loop over tiles of m rows, each within one group.

    Group e's rows are cut into ceil(size_e / m) tiles; tile b of the loop finds its
    group by a search over the cumulative tile counts, reads that group's matrix
    and m rows starting inside the group (the rows past the group's end are
    computed and dropped). The trip count is the number of tiles, at most
    A / m + E, and empty groups have none. 4-bit experts: a tile dequantizes its own
    expert's codes alone.
    """
    num_rows, _ = lhs.shape
    num_local, _, n = rhs.shape
    m = tile_rows(num_rows, group_sizes.shape[0])
    ends = jnp.cumsum(group_sizes)  # [E]
    starts = ends - group_sizes
    ends, starts, sizes = (
        lax.dynamic_slice_in_dim(a, first_group, num_local) for a in (ends, starts, group_sizes)
    )  # [E_local]: this device's groups
    tiles = (sizes + m - 1) // m  # [E_local]
    tile_ends = jnp.cumsum(tiles)  # [E_local]
    lhs = jnp.pad(lhs, ((0, m), (0, 0)))  # a tile starting at row A - 1 stays in bounds
    k = rhs.shape[1]
    # Matrices stacked as rows: a contiguous dynamic slice reads one expert's matrix
    # (~25% faster on XLA:CPU than indexing the 3-D array, which copies it out).
    if isinstance(rhs, Int4Stack):
        groups = rhs.scale.shape[1]
        codes = rhs.codes.reshape(num_local * k, n)
        scales = rhs.scale.reshape(num_local * groups, n)

        def matrix(e):  # [K, N]
            c = lax.dynamic_slice_in_dim(codes, e * k, k)
            s = lax.dynamic_slice_in_dim(scales, e * groups, groups)
            return Int4Stack(c[None], s[None]).dequantize()[0]

    else:
        flat = rhs.reshape(num_local * k, n)

        def matrix(e):  # [K, N]
            return lax.dynamic_slice_in_dim(flat, e * k, k)

    def body(b, out):
        e = jnp.sum(tile_ends <= b, dtype=jnp.int32)  # its group (searchsorted, for few E)
        row0 = starts[e] + (b - (tile_ends[e] - tiles[e])) * m
        rows = lax.dynamic_slice_in_dim(lhs, row0, m)  # [m, K]
        w = matrix(e)  # only this expert
        res = dot_f32(rows, w, (((1,), (0,)), ((), ())))  # [m, N]
        valid = (row0 + jnp.arange(m)) < ends[e]
        old = lax.dynamic_slice_in_dim(out, row0, m)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(valid[:, None], res, old), row0, 0)

    out = lax.fori_loop(0, tile_ends[-1], body, jnp.zeros((num_rows + m, n), jnp.float32))
    return out[:num_rows]


GROUPED_MATMULS = {"ragged_dot": gmm_ragged_dot, "tiles": gmm_tiles}


def moe_grouped(
    x: jax.Array,  # [T, D]
    expert_ids: jax.Array,  # [T, k] int32
    weights: jax.Array,  # [T, k]
    w_gate: jax.Array | Int4Stack,  # [E, D, I]
    w_up: jax.Array | Int4Stack,  # [E, D, I]
    w_down: jax.Array | Int4Stack,  # [E, I, D]
    act,
    gmm=gmm_ragged_dot,
    expert_axis: str | None = None,
) -> jax.Array:  # [T, D] in x's dtype
    """The experts' gated MLPs, each run only on the tokens routed to it (see the
    module docstring); `gmm` is the grouped matmul.

    With `expert_axis` (inside a shard_map over that mesh axis) the weights are this
    device's E / n experts: it computes their assignments only and the psum over
    the axis adds the other devices' parts.
    """
    t, d = x.shape
    k = expert_ids.shape[1]
    num_local = w_gate.shape[0]
    num_experts, first = num_local, 0
    if expert_axis is not None:
        num_experts = num_local * lax.axis_size(expert_axis)
        first = lax.axis_index(expert_axis) * num_local
    flat = expert_ids.reshape(-1)  # [A]
    order = jnp.argsort(flat, stable=True)  # [A]: assignments grouped by expert
    rows = x[order // k]  # [A, D]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]

    def grouped(lhs, w):
        return gmm(lhs, w, group_sizes, first)

    h = act(grouped(rows, w_gate)) * grouped(rows, w_up)  # [A, I] f32
    y = grouped(h.astype(x.dtype), w_down)  # [A, D] f32
    y = y[jnp.argsort(order)].reshape(t, k, d)  # back in token order
    out = jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32))  # [T, D] f32
    if expert_axis is not None:
        out = lax.psum(out, expert_axis)
    return out.astype(x.dtype)


def moe_dense(
    x: jax.Array,  # [T, D]
    expert_ids: jax.Array,  # [T, k] int32
    weights: jax.Array,  # [T, k]
    w_gate: jax.Array,  # [E, D, I]
    w_up: jax.Array,  # [E, D, I]
    w_down: jax.Array,  # [E, I, D]
    act,
) -> jax.Array:  # [T, D]
    """The reference (and the benchmark's baseline): every expert on every token, the
    outputs combined with the router weights (zero for experts not chosen). Computed
    in float32 (XLA:CPU has no bf16 x bf16 -> f32 kernel for some of these dots);
    4-bit experts dequantized."""
    t = x.shape[0]
    w_gate, w_up, w_down = map(dequantized, (w_gate, w_up, w_down))
    num_experts = w_gate.shape[0]
    # Batched over experts (E is a batch dimension of every dot): XLA:CPU runs that as E
    # matmuls on the weights as stored, where "td,edi->tei" would transpose them first.
    xe = jnp.broadcast_to(x.astype(jnp.float32), (num_experts, *x.shape))  # [E, T, D]
    w_gate, w_up, w_down = (w.astype(jnp.float32) for w in (w_gate, w_up, w_down))
    h = act(jnp.einsum("etd,edi->eti", xe, w_gate)) * jnp.einsum("etd,edi->eti", xe, w_up)
    y = jnp.einsum("eti,eid->ted", h, w_down)  # [T, E, D]
    combine = jnp.zeros((t, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(t)[:, None], expert_ids].add(weights.astype(jnp.float32))
    return jnp.einsum("ted,te->td", y, combine).astype(x.dtype)


# The mesh axis `jaxserve.distributed.meshes` shards the experts over (its rule for "expert").
EXPERT_AXIS = "model"

MOE_IMPLS = {
    "ragged_dot": functools.partial(moe_grouped, gmm=gmm_ragged_dot),
    "tiles": functools.partial(moe_grouped, gmm=gmm_tiles),
    "dense": moe_dense,
}


def resolve_impl(impl: str) -> str:
    """'auto' -> 'tiles' on the CPU (where ragged_dot is a masked dense dot), else
    'ragged_dot' (XLA's native ragged dot on TPU and GPU)."""
    if impl != "auto":
        return impl
    return "tiles" if jax.default_backend() == "cpu" else "ragged_dot"


class Experts(nnx.Module):
    """E gated MLPs stacked: gate and up [E, D, I], down [E, I, D].

    `names` are the checkpoint's names for (gate, up, down) under each expert
    (`experts.{e}.<name>.weight`): Mixtral's w1, w3, w2; Qwen's gate/up/down_proj.
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        *,
        names: tuple[str, str, str],
        act: str,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.names = names
        self.act = ACTIVATIONS[act]
        shapes = ((dim, hidden, "mlp"), (dim, hidden, "mlp"), (hidden, dim, "embed"))
        for name, (d_in, d_out, out_axis) in zip(names, shapes, strict=True):
            in_axis = "embed" if out_axis == "mlp" else "mlp"
            value = INIT(rngs.params(), (num_experts, d_in, d_out), dtype)
            axes = ("expert", in_axis, out_axis)
            setattr(self, name, nnx.Param(value, out_sharding=axes, eager_sharding=False))

    def matrices(self) -> tuple:
        """(gate, up, down) as the grouped matmuls take them."""
        return tuple(getattr(self, n)[...] for n in self.names)

    def __call__(self, x, expert_ids, weights, impl: str = "auto"):
        w_gate, w_up, w_down = self.matrices()
        impl = resolve_impl(impl)
        fn = functools.partial(MOE_IMPLS[impl], act=self.act)
        mesh = jax.sharding.get_abstract_mesh()
        n = 1 if mesh.empty or EXPERT_AXIS not in mesh.axis_names else mesh.shape[EXPERT_AXIS]
        if impl != "dense" and n > 1 and w_gate.shape[0] % n == 0:
            fn = jax.shard_map(
                functools.partial(fn, expert_axis=EXPERT_AXIS),
                mesh=mesh,
                in_specs=(P(), P(), P(), P(EXPERT_AXIS), P(EXPERT_AXIS), P(EXPERT_AXIS)),
                out_specs=P(),
                axis_names={EXPERT_AXIS},
                # The loops' carries start replicated and become per-device: skip the
                # varying-type check rather than cast every carry.
                check_vma=False,
            )
        return fn(x, expert_ids, weights, w_gate, w_up, w_down)


class Int4Experts(Experts):
    """`Experts` whose weights are 4-bit (`quantization="int4"`): each of (gate, up,
    down) as int4 codes under its name and a scale per (expert, group of G inputs,
    output) under `<name>_scale` (`Int4Stack`), sharded as the float weights were
    (the groups splitting where the inputs do). Built from float experts
    (`from_experts`): symmetric absmax per group of INT4_GROUP_SIZE inputs, or of
    the largest divisor under it (`int4_group_size`), as `Int4Linear.from_linear`."""

    def __init__(self, names: tuple[str, str, str], act, stacks: dict, axes: dict):
        self.names, self.act = names, act
        for name in names:
            setattr(self, name, _param(stacks[name].codes, axes[name]))
            setattr(self, f"{name}_scale", _param(stacks[name].scale, axes[name]))

    @classmethod
    def from_experts(cls, experts: Experts, group_size: int = INT4_GROUP_SIZE) -> Int4Experts:
        stacks, axes = {}, {}
        for name in experts.names:
            param = getattr(experts, name)
            w = param[...]  # [E, K, N]
            e, k, n = w.shape
            g = int4_group_size(k, group_size)
            codes, scale = quantize(w.reshape(e, k // g, g, n), jnp.int4, axis=2)
            stacks[name] = Int4Stack(codes.reshape(e, k, n), scale.astype(w.dtype))
            axes[name] = _axes(param)
        return cls(experts.names, experts.act, stacks, axes)

    def matrices(self) -> tuple:
        return tuple(
            Int4Stack(getattr(self, n)[...], getattr(self, f"{n}_scale")[...]) for n in self.names
        )


class SparseMoeBlock(nnx.Module):
    """The MoE MLP: a router (`gate`, [D, E], no bias) and the stacked `experts`.

    `impl` is one of MOE_IMPLS or "auto" (static: part of the compiled graph).
    """

    # Linear children `quantize_weights` leaves in the compute dtype: a router's
    # choice is discrete, and int8 rounding of its logits moves tokens to other
    # experts (measured on a random Mixtral: logit errors 8x those of dense layers).
    unquantized = ("gate",)

    def __init__(
        self,
        dim: int,
        *,
        num_experts: int,
        top_k: int,
        hidden: int,
        norm_topk_prob: bool,
        expert_names: tuple[str, str, str],
        act: str,
        dtype,
        rngs: nnx.Rngs,
        impl: str = "auto",
    ):
        if impl != "auto" and impl not in MOE_IMPLS:
            raise ValueError(f"moe impl must be 'auto' or one of {sorted(MOE_IMPLS)}, got {impl!r}")
        self.top_k, self.norm_topk_prob, self.impl = top_k, norm_topk_prob, impl
        kw = dict(dtype=dtype, rngs=rngs)
        # The router is small and every device routes every token: replicated.
        self.gate = linear(dim, num_experts, ("embed", "router"), bias=False, **kw)
        self.experts = Experts(
            num_experts, dim, hidden, names=expert_names, act=act, dtype=dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        ids, weights = route(self.gate(x), self.top_k, norm_topk_prob=self.norm_topk_prob)
        return self.experts(x, ids, weights, impl=self.impl)


def moe_block(
    config: ModelConfig,
    expert_names: tuple[str, str, str],
    *,
    dtype,
    rngs: nnx.Rngs,
    cls=SparseMoeBlock,
) -> SparseMoeBlock:
    """The config's MoE MLP, its experts named as in the family's checkpoints; `cls`
    builds it (a SparseMoeBlock subclass, or a function with its arguments)."""
    m = config.moe
    if m is None:
        raise ValueError(f"{config.architecture} config declares no experts")
    return cls(
        config.hidden_size,
        num_experts=m.num_experts,
        top_k=m.top_k,
        hidden=m.intermediate_size,
        norm_topk_prob=m.norm_topk_prob,
        expert_names=expert_names,
        act=config.hidden_act,
        dtype=dtype,
        rngs=rngs,
    )
