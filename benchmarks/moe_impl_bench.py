"""`jaxserve bench` with the MoE layers' expert computation forced to one implementation.

  python benchmarks/moe_impl_bench.py --moe_impl=dense --model=/tmp/moe1b --mode=offline ...

Every flag but --moe_impl is `jaxserve bench`'s. `--moe_impl` replaces the "auto"
choice of `models.moe` (tiles on the CPU) with tiles, ragged_dot or dense (every
expert on every token: the baseline), for this process only. A benchmark harness,
not an engine option: the engine always runs "auto".
"""

from __future__ import annotations

import sys

from absl import flags

import models.moe

flags.DEFINE_enum("moe_impl", "auto", ["auto", *models.moe.MOE_IMPLS], "Expert computation.")


def main() -> None:
    argv = list(sys.argv)
    impl = next((a.split("=", 1)[1] for a in argv if a.startswith("--moe_impl=")), "auto")
    resolve = models.moe.resolve_impl
    models.moe.resolve_impl = lambda requested: resolve(impl if requested == "auto" else requested)
    from server.cli.main import run

    run(["jaxserve", "bench", *argv[1:]])


if __name__ == "__main__":
    main()
