"""`jaxserve kernels build`: builds the C++ CPU kernels now and says what and where.

  jaxserve kernels build [--native_kernels_dir=DIR]

The engine builds them on first use on the CPU (a few seconds, once per user, CPU,
jaxlib and compiler); this prebuilds them, for an image or a fleet's first start,
into the same per-user cache the engine loads from ($XDG_CACHE_HOME/jaxserve/kernels
or ~/.cache/jaxserve/kernels, or DIR). Run it as the user that serves: a directory
another user could write is refused, by this command and by the engine. The build
is for this CPU (g++ -march=native, keyed by its flags): an image prebuilt on another
CPU model builds again on first start.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from pallas_kernels.cpu import cache, library
from pallas_kernels.cpu.features import isa_features

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "native_kernels_dir",
    "",
    "Where to build (default: $XDG_CACHE_HOME/jaxserve/kernels or ~/.cache/jaxserve/kernels).",
)

USAGE = "usage: jaxserve kernels build [--native_kernels_dir=DIR]"


def main(argv) -> None:
    if argv[1:] != ["build"]:
        raise app.UsageError(f"{USAGE}; got {argv[1:]}")
    directory = FLAGS.native_kernels_dir or cache.default_dir(os.environ)
    t0 = time.perf_counter()
    try:
        path = library.library_path(directory)
        before = os.stat(path).st_ino if os.path.exists(path) else None  # (a build: a new file)
        path = library.build(directory)
        lib = library.dlopen_checked(path)
        missing = [s for s in library.TARGETS.values() if not hasattr(lib, s)]
    except (RuntimeError, OSError) as e:  # refused, locked, no compiler, failed build
        raise SystemExit(f"jaxserve kernels build: {e}") from None
    if missing:
        raise SystemExit(f"jaxserve kernels build: {path} lacks the handlers {missing}")
    seconds = time.perf_counter() - t0
    if before is not None and os.stat(path).st_ino == before:
        print(f"already built: {path}")
    else:
        print(f"built {path} in {seconds:.1f} s")
    key = library.build_key()
    key["cpu_flags"] = f"{len(key['cpu_flags'].split())} flags; {' '.join(isa_features())}"
    for name, value in key.items():
        print(f"  {name}: {value}")
    print(f"  FFI targets: {', '.join(library.TARGETS)}")
