"""The TPU kernels compiled for real, for TPUs that are not here (`jaxserve.targets`):
Mosaic and XLA:TPU from libtpu, on this CPU machine. Lowering alone (test_kernels.py)
does not run Mosaic's checks (tile-aligned DMA windows and vector loads, VMEM), so a
kernel that lowers can still fail to compile.

A pairwise-covering grid over the kernel's parameters (every pair of any two factors'
levels appears in some case), on v5e and v6e; v4 and v5p where the kernel's choices
differ (block sizes picked for their VMEM). Each case compiles the attention kernel and
the KV write for a realistic pool (65,536 tokens of pages, a 2,048-token page table).
"""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import ragged_paged_attention_tpu as tpu
from pallas_kernels import tpu_block_sizes
from pallas_kernels.kv_layout import CacheLayout
from pallas_kernels.ragged_paged_attention import attention_cost
from pallas_kernels.tpu_block_sizes import TpuBlockSizes

POOL_TOKENS = 4096 * 16
TABLE_TOKENS = 2048
BATCHES = {"decode": (64, 64), "mixed": (512, 16)}  # (T, B): the shapes depend on nothing else
ATTENTION = {  # sliding window / soft cap
    "plain": {},
    "window": dict(sliding_window=1024),
    "cap": dict(soft_cap=30.0),
    "window+cap": dict(sliding_window=512, soft_cap=50.0),
}
DTYPES = {
    "bf16": jnp.bfloat16,
    "f32": jnp.float32,
    "int8": jnp.int8,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}
FACTORS = {
    "chip": ["v5e", "v6e"],
    "q": ["bf16", "f32"],
    "kv": ["bf16", "f32", "int8", "fp8_e4m3"],
    "head_dim": [64, 80, 128, 256],
    "group": [1, 2, 4, 7, 8],  # query heads per KV head
    "kv_heads": [1, 2, 4, 8, 16],
    "page_size": [16, 32, 64, 128],
    "batch": list(BATCHES),
    "attention": list(ATTENTION),
}


def pairwise(factors: dict[str, list]) -> list[dict]:
    """Cases covering every pair of levels of any two factors (greedy, deterministic):
    each case starts from the first uncovered pair and fills the other factors with
    the level covering the most uncovered pairs so far."""
    names = list(factors)
    levels = {n: range(len(factors[n])) for n in names}

    def pairs(case):
        return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}

    uncovered = {
        (a, i, b, j)
        for a, b in itertools.combinations(names, 2)
        for i in levels[a]
        for j in levels[b]
    }
    cases = []
    while uncovered:
        a, i, b, j = min(
            uncovered, key=lambda p: (names.index(p[0]), p[1], names.index(p[2]), p[3])
        )
        case = {a: i, b: j}
        for n in names:
            if n not in case:
                case[n] = max(
                    levels[n],
                    key=lambda v, n=n: sum(
                        (m, case[m], n, v) in uncovered or (n, v, m, case[m]) in uncovered
                        for m in case
                    ),
                )
        uncovered -= pairs(case)
        cases.append({n: factors[n][case[n]] for n in names})
    return cases


def case_id(case: dict) -> str:
    table = f"-table{case['table_tokens']}" if "table_tokens" in case else ""
    return (
        f"{case['chip']}-q{case['q']}-kv{case['kv']}-h{case['head_dim']}-g{case['group']}"
        f"-k{case['kv_heads']}-s{case['page_size']}-{case['batch']}-{case['attention']}{table}"
    )


def case_with(**levels) -> dict:
    """A case named by the levels that matter to it; the others as most models have."""
    defaults = dict(q="bf16", kv="bf16", head_dim=128, group=4, kv_heads=8, page_size=16)
    return defaults | dict(batch="mixed", attention="plain") | levels


CASES = pairwise(FACTORS)
EXTRA_CASES = [
    # float8_e5m2 once; a 32k-token page table once.
    dict(CASES[0], kv="fp8_e5m2"),
    dict(CASES[1], batch="mixed", table_tokens=32768),
    # v4 and v5p: for_device sizes these for their VMEM (v4: 16 MiB, so 8 query rows
    # for head_dim 256 with a 16-head block; v5p: 64 MiB).
    case_with(chip="v4", kv="int8", head_dim=256, group=8, kv_heads=16, attention="cap"),
    case_with(chip="v4", q="f32", page_size=32, batch="decode", attention="window"),
    case_with(chip="v5p", kv="fp8_e4m3", head_dim=256, group=8, kv_heads=16, page_size=64),
    case_with(chip="v5p", head_dim=80, group=7, kv_heads=2, batch="decode", attention="window+cap"),
]
# The largest head block the kernel makes: 16 KV heads (32 int8 rows) of 8 query heads.
LARGEST_HEAD_BLOCK = dict(kv="int8", head_dim=256, group=8, kv_heads=16)


@pytest.fixture(scope="module")
def devices():
    """One compile-only device per chip (libtpu's topologies), made once."""
    from jaxserve.targets import Target

    made = {}

    def get(chip: str):
        if chip not in made:
            made[chip] = Target.parse(chip).devices()[0]
        return made[chip]

    return get


def _structs(device, shapes_and_dtypes):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes_and_dtypes]


def _compile(device, fn, args, **jit_kw):
    from jaxserve.compile_records import compile_for
    from jaxserve.targets import compiling_for

    with compiling_for(device):
        return compile_for(jax.jit(fn, **jit_kw).lower(*args), [device])


def attention_args(case: dict):
    """(queries, pages, kv_lens, page_indices, cu_q_lens, num_seqs[, scales]) shapes,
    the cache lane-dense as the engine stores it for TPUs."""
    t, b = BATCHES[case["batch"]]
    s, k, h = case["page_size"], case["kv_heads"], case["head_dim"]
    num_pages = POOL_TOKENS // s
    layout = CacheLayout(k, h, s, lane_dense=True)
    table = case.get("table_tokens", TABLE_TOKENS) // s
    q_dtype, kv_dtype = DTYPES[case["q"]], DTYPES[case["kv"]]
    args = [
        ((t, case["group"] * k, h), q_dtype),
        (layout.pages_shape(num_pages), kv_dtype),
        ((b,), jnp.int32),
        ((b, table), jnp.int32),
        ((b + 1,), jnp.int32),
        ((1,), jnp.int32),
    ]
    if jnp.dtype(kv_dtype).itemsize == 1:
        args.append((layout.scales_shape(num_pages), jnp.float32))
    return args


def block_sizes(device, case: dict) -> TpuBlockSizes:
    return TpuBlockSizes.for_device(
        device.device_kind,
        case["head_dim"],
        num_heads=case["group"] * case["kv_heads"],
        num_kv_heads=case["kv_heads"],
        page_size=case["page_size"],
        q_dtype=DTYPES[case["q"]],
        kv_dtype=DTYPES[case["kv"]],
    )


def reserved_vmem(compiled) -> int:
    """Scoped VMEM XLA reserves for the attention kernel's custom call."""
    for line in compiled.as_text().split("\n"):
        if 'custom_call_target="tpu_custom_call"' in line and "ragged_paged_attention" in line:
            found = re.search(
                r'"used_scoped_memory_configs":\[\{"memory_space":"1","offset":"0","size":"(\d+)"',
                line,
            )
            assert found, "no scoped VMEM size in the attention kernel's backend config"
            return int(found.group(1))
    raise AssertionError("no attention custom call in the compiled program")


def check_attention_compiles(device, case: dict, sizes: TpuBlockSizes | None = None):
    """Compiles the attention kernel for `case` on `device` (block sizes from
    `for_device` unless given) and checks what XLA says it costs; returns it."""
    sizes = sizes or block_sizes(device, case)
    shapes = attention_args(case)
    fn = functools.partial(
        tpu.ragged_paged_attention,
        sm_scale=0.1,
        block_sizes=sizes,
        num_kv_heads=case["kv_heads"],
        **ATTENTION[case["attention"]],
    )
    compiled = _compile(device, fn, _structs(device, shapes))
    (queries, _), (cache, kv_dtype), _, (table, _), *_ = shapes
    want = attention_cost(
        jax.ShapeDtypeStruct(queries, DTYPES[case["q"]]),
        jax.ShapeDtypeStruct(table, jnp.int32),
        page_size=case["page_size"],
        kv_bytes_per_position=cache[2] * jnp.dtype(kv_dtype).itemsize,  # (scales aside)
        flop_head_dim=case["head_dim"],
        block_q=sizes.block_q,
        block_kv=sizes.resolve_pages_per_block(case["page_size"]) * case["page_size"],
        sliding_window=ATTENTION[case["attention"]].get("sliding_window"),
        soft_cap=ATTENTION[case["attention"]].get("soft_cap"),
    )
    cost = compiled.cost_analysis()
    # XLA counts what the kernel's CostEstimate says (a Pallas call without one is 0).
    assert cost["flops"] >= want.flops > 0
    assert cost["bytes accessed"] >= want.bytes_accessed > 0
    # The VMEM budget `for_device` sizes blocks by is an upper bound of what XLA reserves.
    budget = tpu_block_sizes.kernel_vmem_bytes(
        sizes.block_q,
        min(sizes.resolve_pages_per_block(case["page_size"]), table[1]),
        num_heads=queries[1],
        num_kv_heads=case["kv_heads"],
        head_dim=case["head_dim"],
        page_size=case["page_size"],
        q_dtype=DTYPES[case["q"]],
        kv_dtype=kv_dtype,
    )
    assert 0 < reserved_vmem(compiled) <= budget
    assert budget <= tpu_block_sizes.vmem_capacity(device.device_kind)
    return compiled


def check_write_compiles(device, case: dict):
    """Compiles the KV write for `case`'s pages and batch, its cache donated."""
    t, _ = BATCHES[case["batch"]]
    s, k, h = case["page_size"], case["kv_heads"], case["head_dim"]
    kv_dtype = DTYPES[case["kv"]]
    pages = (CacheLayout(k, h, s, lane_dense=True).pages_shape(POOL_TOKENS // s), kv_dtype)
    new = ((t, k, h), kv_dtype if jnp.dtype(kv_dtype).itemsize == 1 else DTYPES[case["q"]])
    args = _structs(device, [pages, new, new, ((t,), jnp.int32)])
    compiled = _compile(device, tpu.write_kv, args, donate_argnums=0)  # in place, as the engine
    assert (
        compiled.cost_analysis()["bytes accessed"]
        >= 2 * t * 2 * k * h * jnp.dtype(kv_dtype).itemsize
    )
    return compiled


@pytest.mark.parametrize("case", CASES + EXTRA_CASES, ids=case_id)
def test_kernels_compile_for_tpu(devices, case):
    device = devices(case["chip"])
    check_attention_compiles(device, case)
    check_write_compiles(device, case)


def test_the_grid_covers_every_pair_of_levels():
    """Any two factors' levels meet in some case, in far fewer cases than the product."""
    covered = {
        (a, case[a], b, case[b]) for case in CASES for a, b in itertools.combinations(FACTORS, 2)
    }
    for a, b in itertools.combinations(FACTORS, 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            assert (a, va, b, vb) in covered
    assert len(CASES) < 40  # not the product (2 * 2 * 4 * 4 * 5 * 5 * 4 * 2 * 4 = 51,200)


def test_bf16_queries_compile_for_v5e_which_failed_before_the_query_dma_fix(devices):
    """Every bfloat16-query case failed here before: the query block was DMA'd from a
    [K, G, T, H] array at a traced token offset on the tiled sublane axis ("Offsets
    along tiled dimensions must be aligned to tiles ... divisible by the tile dimension
    8"). Queries are now [T, K, G, H], the token axis untiled."""
    failed = case_with(chip="v5e", kv_heads=2)
    device = devices("v5e")
    check_attention_compiles(device, failed, TpuBlockSizes(block_q=16))
    assert block_sizes(device, failed) == TpuBlockSizes(block_q=16)  # as for_device sizes it


@pytest.mark.parametrize("chip", ["v4", "v5e", "v5p", "v6e"])
def test_block_sizes_from_head_dim_alone_fit_the_largest_head_block(devices, chip):
    """What the attention backend asks for today (`for_device(kind, head_dim)`, no head
    counts) is sized for the largest head block the kernel makes (16 KV heads of 8 query
    heads, int8 pages): it compiles, at head_dim 256, within the generation's VMEM."""
    device = devices(chip)
    sizes = TpuBlockSizes.for_device(device.device_kind, 256)
    assert sizes.block_q == (8 if chip == "v4" else 16)
    check_attention_compiles(device, case_with(chip=chip, **LARGEST_HEAD_BLOCK), sizes)


def test_block_sizes_that_do_not_fit_are_refused_by_the_compiler_and_by_for_device(devices):
    """The VMEM capacities are the compiler's: 32 query rows of the largest head block at
    head_dim 256 need more than v4's 16 MiB, and for_device never picks them."""
    too_big = case_with(chip="v4", **LARGEST_HEAD_BLOCK)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        check_attention_compiles(devices("v4"), too_big, TpuBlockSizes(block_q=32))
    with pytest.raises(ValueError, match="needs .* bytes of VMEM"):
        TpuBlockSizes.for_device("TPU v4", 2048, num_heads=128, num_kv_heads=16)


def test_no_whole_cache_copies_around_the_kernels(devices):
    """XLA:TPU gave a [P, S, 2K, 64] cache parameter (and [P, S, 2K] scales) a layout of
    its own, page axis minor, and copied the whole cache around every kernel call. The
    lane-dense cache (`pallas_kernels.kv_layout`) is passed as it is: the compiled
    programs have no cache-sized copy or transpose, nor such temporaries."""
    from jaxserve.preflight import kv_sized_copies

    device = devices("v5e")
    for head_dim in (64, 80, 128):
        for kv in ("bf16", "int8"):
            case = case_with(chip="v5e", head_dim=head_dim, kv=kv, kv_heads=2, group=2)
            shapes = attention_args(case)
            caches = [shapes[1][0]] + ([shapes[6][0]] if len(shapes) == 7 else [])
            for compiled in (
                check_attention_compiles(device, case),
                check_write_compiles(device, case),
            ):
                assert kv_sized_copies(compiled.as_text(), caches) == [], case_id(case)
                cache_bytes = POOL_TOKENS * 2 * 2 * head_dim * jnp.dtype(DTYPES[kv]).itemsize
                assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes // 4
