"""Runs the test suite as README.md gives it: one pytest process per test folder.

Each folder (jaxserve_tests, models_tests, pallas_kernels_tests, server_tests)
runs in a fresh process, so what one leaves behind (compiled programs, engines,
threads, native libraries' state) cannot bring down another: in one process of
~1000 tests, runs have died in XLA late in the server tests (a segfault or abort
inside compilation), which separate processes avoid while it is investigated.
Extra arguments go to every pytest (e.g. `-m "not slow"`, `-x`). Exits non-zero
if any folder fails or runs no test.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"


def main(argv: list[str]) -> int:
    folders = sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name.endswith("_tests"))
    totals: dict[str, int] = {}
    failed = []
    for folder in folders:
        print(f"\n=== {folder.relative_to(TESTS.parent)}", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", str(folder), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        sys.stdout.write(proc.stdout)
        sys.stdout.flush()
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        for count, what in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last):
            totals[what] = totals.get(what, 0) + int(count)
        if proc.returncode != 0:  # 5 (no tests ran) included
            failed.append(f"{folder.name} (exit {proc.returncode})")
    summary = ", ".join(f"{totals.get(k, 0)} {k}" for k in ("passed", "failed"))
    print(f"\n{summary}" + (f"; failing: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
