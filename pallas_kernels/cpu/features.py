"""What this machine's CPU can do, from /proc/cpuinfo: the one place it is probed.

The native build keys on the flags (`-march=native` compiles for them), compiled
bundles record the instruction-set extensions XLA:CPU may have used, and the
runner asks whether a compute dtype is fast here.
"""

from __future__ import annotations

import functools

# Flags naming instruction-set extensions a compiler (g++ or XLA:CPU) may target.
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse", "vpclmul", "gfni", "vaes")


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's feature flags (x86: "flags", Arm: "Features"); empty
    where the file cannot be read (not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def isa_features() -> list[str]:
    """The instruction-set extensions among the flags, sorted (a compiled program's
    target)."""
    return sorted(f for f in cpu_flags() if f.startswith(_ISA_PREFIXES))


def fast_dtype(dtype: str) -> bool:
    """float32 always; bfloat16 where the CPU multiplies it natively, with AMX or
    AVX512-BF16 (measured faster than float32 on a Sapphire Rapids Xeon and a Zen 4
    EPYC: benchmarks/README.md); float16 never."""
    if dtype == "float32":
        return True
    return dtype == "bfloat16" and bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
