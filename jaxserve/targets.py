"""Devices that are not here: TPU and GPU targets to compile for, from a CPU host.

JAX compiles ahead of time for a device it does not have (as MaxText and AxLearn
do for TPU pods from CPU hosts): `jax.experimental.topologies` gives compile-only
devices of a named topology, and `jax.jit(f).lower(args).compile()` on arguments
placed on them runs the device compilers for real (Mosaic and XLA:TPU with
libtpu; Triton and XLA:GPU with the CUDA plugin). Nothing runs: the compiled
programs can be analysed (bytes, flops, memory) and serialized.

A target is a chip and a count: `v5e-8`, `v6e-4`, `v5e` (one chip), `h100x8`,
`a100x4`. TPU counts are chips (`v4-8`/`v5p-8` as Google names them count
TensorCores: 4 chips). `Target.devices()` needs the compiler of its platform:
`pip install "jax[tpu]==<jax>"` (libtpu) for TPUs, `jax-cuda12-plugin` and
`jax-cuda12-pjrt` at the jax version for GPUs (the test extras install both).
The process must not have initialised a CUDA backend (on a machine without a GPU,
run with JAX_PLATFORMS=cpu: `jaxserve preflight` sets it), libtpu must be told not
to query a TPU VM's metadata server (TPU_SKIP_MDS_QUERY=1), and, for several
processes to compile at once, that libtpu may be loaded by more than one
(ALLOW_MULTIPLE_LIBTPU_LOAD=1): the CLI and the tests set both.

The chips' figures are their makers' published ones (HBM per chip, HBM
bandwidth, dense bfloat16 peak), used for capacity and for roofline estimates.
"""

from __future__ import annotations

import dataclasses
import re

import jax

# The engine arguments of each platform's preset (configs/tpu.toml, configs/gpu.toml;
# a test keeps these equal to the files): `jaxserve preflight` without --config uses
# them, under the flags given. (Here, not beside the flags: a test reads them in a
# process that may define other commands' flags.)
DEVICE_PRESETS = {
    "tpu": dict(
        dtype="bfloat16",
        attention_backend="pallas_tpu",
        block_size=32,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        kv_cache_memory_fraction=0.9,
    ),
    "cuda": dict(
        dtype="bfloat16",
        attention_backend="pallas_gpu",
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        kv_cache_memory_fraction=0.9,
    ),
}


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    platform: str  # "tpu" or "cuda" (jax's platform names)
    device_kind: str  # as jax reports it
    hbm_bytes: int  # per chip
    hbm_bandwidth: float  # bytes/s
    peak_flops: float  # dense bfloat16 flop/s
    # TPU: topology names by the device count they give, smallest first.
    tpu_topologies: tuple[tuple[int, str], ...] = ()
    gpu_config: str = ""  # GpuTargetConfigProto text (GPU)
    counts_cores: bool = False  # v4-N / v5p-N name TensorCores: N / 2 chips
    # The share of HBM the runtime gives JAX (its `bytes_limit`): XLA's GPU client takes
    # 75% by default (XLA_PYTHON_CLIENT_MEM_FRACTION); a TPU's runtime reserves little.
    usable_fraction: float = 1.0


def _gpu_config(
    *,
    name: str,
    major: int,
    cores: int,
    fpus: int,
    smem_per_core: int,
    smem_optin: int,
    bandwidth: int,
    l2: int,
    clock: float,
    memory: int,
) -> str:
    """The GpuTargetConfigProto (text format) XLA:GPU and Triton compile against:
    the device facts that this jaxlib's parser reads."""
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {smem_per_core}
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: {memory}
  shared_memory_per_block_optin: {smem_optin}
  cuda_compute_capability {{ major: {major} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{name}"
"""


_GIB = 2**30
_SMALL_TPU = ((4, "2x2"), (8, "2x4"), (16, "4x4"))
CHIPS: dict[str, Chip] = {
    "v4": Chip(
        "v4", "tpu", "TPU v4", 32 * _GIB, 1.2e12, 275e12, ((4, "2x2x1"),), counts_cores=True
    ),
    "v5e": Chip("v5e", "tpu", "TPU v5 lite", 16 * _GIB, 8.19e11, 197e12, _SMALL_TPU),
    "v5p": Chip(
        "v5p", "tpu", "TPU v5", 95 * _GIB, 2.765e12, 459e12, ((4, "2x2x1"),), counts_cores=True
    ),
    "v6e": Chip("v6e", "tpu", "TPU v6 lite", 32 * _GIB, 1.64e12, 918e12, _SMALL_TPU),
    "h100": Chip(
        "h100",
        "cuda",
        "NVIDIA H100 80GB HBM3",
        84_942_979_072,
        3.35e12,
        989e12,
        usable_fraction=0.75,
        gpu_config=_gpu_config(
            name="NVIDIA H100 80GB HBM3",
            major=9,
            cores=132,
            fpus=128,
            smem_per_core=233472,
            smem_optin=232448,
            bandwidth=3_352_320_000_000,
            l2=52_428_800,
            clock=1.98,
            memory=84_942_979_072,
        ),
    ),
    "a100": Chip(
        "a100",
        "cuda",
        "NVIDIA A100-SXM4-80GB",
        85_100_068_864,
        2.039e12,
        312e12,
        usable_fraction=0.75,
        gpu_config=_gpu_config(
            name="NVIDIA A100-SXM4-80GB",
            major=8,
            cores=108,
            fpus=64,
            smem_per_core=167936,
            smem_optin=166912,
            bandwidth=2_039_040_000_000,
            l2=41_943_040,
            clock=1.41,
            memory=85_100_068_864,
        ),
    ),
}

_TARGET = re.compile(r"^(?P<chip>[a-z0-9]+?)(?:(?:-|x)(?P<count>\d+))?$")


@dataclasses.dataclass(frozen=True)
class Target:
    """A chip and how many of them one engine (its tensor-parallel group) may use."""

    chip: Chip
    num_chips: int

    @classmethod
    def parse(cls, text: str) -> Target:
        """'v5e-8', 'v6e', 'h100x8', 'a100x4', 'v4-8' (TensorCores: 4 chips)."""
        match = _TARGET.match(text.strip().lower())
        chip = CHIPS.get(match["chip"]) if match else None
        if chip is None:
            raise ValueError(
                f"target must be a chip and a count such as v5e-8, v6e-4, h100x8 or a100x4 "
                f"(chips: {', '.join(CHIPS)}); got {text!r}"
            )
        count = int(match["count"] or (2 if chip.counts_cores else 1))
        if chip.counts_cores:
            if count % 2:
                raise ValueError(f"target {text!r}: {chip.name}-N counts TensorCores, N even")
            count //= 2
        if count <= 0:
            raise ValueError(f"target {text!r} names {count} chips")
        return cls(chip, count)

    @property
    def name(self) -> str:
        if self.chip.platform == "cuda":
            return f"{self.chip.name}x{self.num_chips}"
        n = self.num_chips * (2 if self.chip.counts_cores else 1)
        return f"{self.chip.name}-{n}"

    @property
    def platform(self) -> str:
        return self.chip.platform

    def devices(self) -> list:
        """`num_chips` compile-only devices of this target (needs its compiler)."""
        from jax.experimental import topologies

        chip = self.chip
        try:
            if chip.platform == "tpu":
                fits = [name for n, name in chip.tpu_topologies if n >= self.num_chips]
                if not fits:
                    most = chip.tpu_topologies[-1][0]
                    raise ValueError(f"target {self.name}: at most {most} {chip.name} chips")
                topo = topologies.get_topology_desc(
                    topology_name=f"{chip.name}:{fits[0]}", platform="tpu"
                )
            else:
                topo = topologies.get_topology_desc(
                    platform="cuda",
                    topology_name=chip.name,
                    target_config=chip.gpu_config,
                    topology=f"1x1x{self.num_chips}",
                )
        except (RuntimeError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
            raise RuntimeError(f"cannot compile for {self.name} here: {e}{_hint(chip)}") from e
        return list(topo.devices)[: self.num_chips]

    @property
    def device_bytes_limit(self) -> int:
        """The `bytes_limit` a device of this target reports to JAX (what the KV budget
        `kv_cache_memory_fraction` is a fraction of, on the device as here)."""
        return int(self.chip.hbm_bytes * self.chip.usable_fraction)


def _hint(chip: Chip) -> str:
    """What to install or set where a target's compile-only devices cannot be made."""
    import importlib.util

    if chip.platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            return f' (install libtpu: pip install "jax[tpu]=={jax.__version__}")'
        return (
            " (another process may hold libtpu: ALLOW_MULTIPLE_LIBTPU_LOAD=1 lets several "
            "compile-only processes load it)"
        )
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return f' (install the CUDA plugin: pip install "jax[cuda12-local]=={jax.__version__}")'
    return " (on a machine without a GPU, run with JAX_PLATFORMS=cpu)"


def compiling_for(device):
    """The context to lower in for `device`: its default device, which Pallas Mosaic
    asks for the TPU generation it compiles for, and the attention backends for the
    device kind their block sizes depend on (`pallas_kernels.backends`)."""
    return jax.default_device(device)
