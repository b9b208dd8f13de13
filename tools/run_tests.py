"""Runs the test suite as README.md gives it: pytest processes of at most
FILES_PER_PROCESS test files each, folder by folder.

Each group of files (of jaxserve_tests, models_tests, pallas_kernels_tests,
server_tests) runs in a fresh process, so what one leaves behind (compiled
programs, engines, threads, native libraries' state) cannot bring down another.
Long single processes used to die inside XLA (a segfault or abort ~60% into a
750-test folder, every file passing alone): the cause was the kernel's limit on a
process's memory mappings (`vm.max_map_count`, 65,530), which XLA:CPU's compiled
programs used up; `tests/conftest.py` now releases them after each module, and
the fresh processes keep a margin. Extra arguments go to every pytest
(e.g. `-m "not slow"`, `-x`). Exits non-zero if any group fails (a crash
included) or a folder runs no test.

`--accelerator` runs the accelerator suite instead, on a GPU or TPU machine: the
tests marked `accelerator` (native Pallas kernels against the reference, greedy
parity of the engine on the device against the CPU, `jaxserve bench --roofline`),
in one pytest process on the machine's own platform. Only the files that hold
such tests are collected, so the machine needs jaxserve, its device's JAX and
pytest, not the test extras (torch, transformers, ... for the CPU suite).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
FILES_PER_PROCESS = 12
NO_TESTS = 5  # pytest's exit code when nothing ran (e.g. all deselected)
_MARK = "pytest.mark.accelerator"


def main(argv: list[str]) -> int:
    if "--accelerator" in argv:
        argv = [a for a in argv if a != "--accelerator"]
        env = {**os.environ, "JAXSERVE_TEST_ACCELERATOR": "1"}
        files = [str(p) for p in sorted(TESTS.rglob("test_*.py")) if _MARK in p.read_text()]
        cmd = [sys.executable, "-m", "pytest", *files, "-m", "accelerator", "-s", *argv]
        return subprocess.run(cmd, env=env).returncode
    folders = sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name.endswith("_tests"))
    totals: dict[str, int] = {}
    failed = []
    for folder in folders:
        files = sorted(str(p) for p in folder.glob("test_*.py"))
        groups = [files[i : i + FILES_PER_PROCESS] for i in range(0, len(files), FILES_PER_PROCESS)]
        codes = []
        for group in groups:
            print(f"\n=== {folder.relative_to(TESTS.parent)}: {len(group)} files", flush=True)
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", *group, *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            sys.stdout.write(proc.stdout)
            sys.stdout.flush()
            last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            for count, what in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last):
                totals[what] = totals.get(what, 0) + int(count)
            if proc.returncode < 0:
                print(f"\n!!! pytest died of signal {-proc.returncode}", flush=True)
            codes.append(proc.returncode)
        if any(c not in (0, NO_TESTS) for c in codes) or all(c == NO_TESTS for c in codes):
            failed.append(f"{folder.name} (exit codes {codes})")
    summary = ", ".join(f"{totals.get(k, 0)} {k}" for k in ("passed", "failed"))
    print(f"\n{summary}" + (f"; failing: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
