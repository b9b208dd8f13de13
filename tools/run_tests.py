"""Runs the test suite as README.md gives it: pytest processes of at most
FILES_PER_PROCESS test files of one folder each (a long file's tests split over
several), JOBS of them at a time.

Each group of files (of jaxserve_tests, models_tests, pallas_kernels_tests,
server_tests) runs in a fresh process, so what one leaves behind (compiled
programs, engines, threads, native libraries' state) cannot bring down another.
Long single processes used to die inside XLA (a segfault or abort ~60% into a
750-test folder, every file passing alone): the cause was the kernel's limit on a
process's memory mappings (`vm.max_map_count`, 65,530), which XLA:CPU's compiled
programs used up; `tests/conftest.py` now releases them after each module, and
the fresh processes keep a margin.

Two processes run side by side (`--jobs`): one test's Python, tracing and waiting
leaves a core idle that the other's compiling and stepping takes. Groups are packed
from the last run's test durations (kept beside the test compilation cache,
`tests/cache_dir.py`) and started longest first, so the two finish together. A
group starts only while the machine has MIN_FREE_BYTES of memory available, so two
never push it into the out-of-memory killer; each group's peak memory is printed.

At the end: each group's wall time and peak memory, the total, the SLOWEST tests,
and one "N passed, N failed" line. Extra arguments go to every pytest (e.g.
`-m "not slow"`, `-x`). Exits non-zero if any group fails (a crash included) or a
folder runs no test.

`--accelerator` runs the accelerator suite instead, on a GPU or TPU machine: the
tests marked `accelerator` (native Pallas kernels against the reference, greedy
parity of the engine on the device against the CPU, `jaxserve bench --roofline`),
in one pytest process on the machine's own platform. Only the files that hold
such tests are collected, so the machine needs jaxserve, its device's JAX and
pytest, not the test extras (torch, transformers, ... for the CPU suite).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
from cache_dir import test_cache_dir  # noqa: E402

FILES_PER_PROCESS = 12
GROUP_SECONDS = 300  # a group's expected time: a heavier folder gets more groups
JOBS = 2
MIN_FREE_BYTES = 6 << 30  # memory a group needs free to start beside another
SLOWEST = 15
NO_TESTS = 5  # pytest's exit code when nothing ran (e.g. all deselected)
DURATIONS = "durations.json"  # seconds per test file, from the last run
# A new machine's (no last run): a cold run's, committed (`tests/durations.json`).
COLD_DURATIONS = TESTS / DURATIONS
_MARK = "pytest.mark.accelerator"


@dataclasses.dataclass
class Group:
    folder: str
    files: list[str]
    expected: float  # seconds, from the last run (or the files' sizes)
    proc: subprocess.Popen | None = None
    junit: str = ""
    log: object = None
    started: float = 0.0
    seconds: float = 0.0
    peak_bytes: int = 0
    code: int = 0

    def describe(self) -> str:
        """Its files, or the file and how many of its tests (a split file's share)."""
        if any("::" in f for f in self.files):
            file = pathlib.Path(self.files[0].split("::")[0]).stem
            return f"{self.folder}: {len(self.files)} tests of {file}"
        return f"{self.folder}: {', '.join(pathlib.Path(f).stem for f in self.files)}"


def main(argv: list[str]) -> int:
    if "--accelerator" in argv:
        argv = [a for a in argv if a != "--accelerator"]
        env = {**os.environ, "JAXSERVE_TEST_ACCELERATOR": "1"}
        files = [str(p) for p in sorted(TESTS.rglob("test_*.py")) if _MARK in p.read_text()]
        cmd = [sys.executable, "-m", "pytest", *files, "-m", "accelerator", "-s", *argv]
        return subprocess.run(cmd, env=env).returncode
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--jobs", type=int, default=JOBS)
    ours, pytest_args = parser.parse_known_args(argv)
    if ours.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {ours.jobs}")
    cache = test_cache_dir()
    last = _read_durations(cache)
    groups = _groups(last)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        _run(groups, pytest_args, ours.jobs, tmp)
        tests = _test_times(groups)
        total = time.perf_counter() - t0
        if cache:
            _write_durations(cache, last, tests)
        return _report(groups, tests, total)  # (reads the groups' JUnit files in tmp)


def _groups(last: dict[str, float]) -> list[Group]:
    """Each folder's files packed into groups of at most FILES_PER_PROCESS files and
    about GROUP_SECONDS (a file never split), balanced by expected time (longest file
    first into the least loaded group); the groups longest first, so that the last to
    finish are short."""
    groups = []
    for folder in sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name.endswith("_tests")):
        files = sorted(folder.glob("test_*.py"))
        if not files:
            continue
        # A file never run before: a second per 10 lines (about what compiling tests cost).
        cost = {
            str(f): last.get(str(f.relative_to(TESTS.parent)), len(f.read_text()) / 400)
            for f in files
        }
        # A file of more than two groups' time is split: its tests dealt out in turn (a
        # parametrized grid's cases alternate) to processes of about GROUP_SECONDS each.
        for f in [f for f, seconds in cost.items() if seconds > 2 * GROUP_SECONDS]:
            parts = round(cost[f] / GROUP_SECONDS)
            ids = _test_ids(f)
            for i in range(min(parts, len(ids))):
                groups.append(Group(folder.name, ids[i::parts], cost[f] / parts))
            if ids:
                del cost[f]
        by_time = round(sum(cost.values()) / GROUP_SECONDS)
        count = min(len(cost), max(-(-len(cost) // FILES_PER_PROCESS), by_time))
        packed = [Group(folder.name, [], 0.0) for _ in range(count)]
        for f in sorted(cost, key=cost.get, reverse=True):
            group = min(
                (g for g in packed if len(g.files) < FILES_PER_PROCESS), key=lambda g: g.expected
            )
            group.files.append(f)
            group.expected += cost[f]
        groups += packed
    return sorted(groups, key=lambda g: g.expected, reverse=True)


def _test_ids(path: str) -> list[str]:
    """A test file's test ids, in order (pytest's collection; [] if it fails: the file
    then runs whole, and reports the failure)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path],
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
    )
    return [line for line in proc.stdout.splitlines() if "::" in line]


def _run(groups: list[Group], pytest_args: list[str], jobs: int, tmp: str) -> None:
    waiting, running = list(groups), []
    while waiting or running:
        while waiting and len(running) < jobs and (not running or _available() >= MIN_FREE_BYTES):
            group = waiting.pop(0)
            group.junit = os.path.join(tmp, f"{id(group)}.xml")
            group.log = open(os.path.join(tmp, f"{id(group)}.log"), "w+")  # noqa: SIM115
            print(f"=== start {group.describe()}", flush=True)
            group.started = time.perf_counter()
            group.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    *sorted(group.files),
                    *pytest_args,
                    f"--junitxml={group.junit}",
                ],
                stdout=group.log,
                stderr=subprocess.STDOUT,
                cwd=TESTS.parent,  # (a split file's test ids are relative to it)
            )
            running.append(group)
        pid, status, usage = os.wait4(-1, 0)
        group = next(g for g in running if g.proc.pid == pid)
        running.remove(group)
        group.proc.returncode = group.code = os.waitstatus_to_exitcode(status)
        group.seconds = time.perf_counter() - group.started
        group.peak_bytes = usage.ru_maxrss * 1024
        group.log.seek(0)
        out = group.log.read()
        group.log.close()
        print(
            f"\n=== {group.describe()}: {group.seconds:.0f}s\n{out}",
            flush=True,
        )
        if group.code < 0:
            print(f"\n!!! pytest died of signal {-group.code}", flush=True)


def _available() -> int:
    """MemAvailable, in bytes (Linux); elsewhere, as if there were room."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return MIN_FREE_BYTES


def _test_times(groups: list[Group]) -> dict[str, float]:
    """Seconds per test (setup, call and teardown), from each group's JUnit XML."""
    times = {}
    for group in groups:
        if not os.path.exists(group.junit):
            continue
        for case in ET.parse(group.junit).iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            times[name] = times.get(name, 0.0) + float(case.get("time") or 0.0)
    return times


def _file_of(test: str) -> str:
    """'tests.jaxserve_tests.test_x::test_y[a]' -> 'tests/jaxserve_tests/test_x.py'."""
    module = test.split("::")[0]
    parts = module.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()  # a test class's name
    return "/".join(parts) + ".py"


def _read_durations(cache: str) -> dict[str, float]:
    """The last run's seconds per file, over a cold run's (committed) for the rest."""
    found = {}
    for path in (COLD_DURATIONS, os.path.join(cache, DURATIONS) if cache else None):
        try:
            with open(path) as f:
                found.update(json.load(f))
        except (OSError, TypeError, ValueError):
            pass
    return found


def _write_durations(cache: str, last: dict[str, float], tests: dict[str, float]) -> None:
    per_file = dict(last)
    ran: dict[str, float] = {}
    for test, seconds in tests.items():
        ran[_file_of(test)] = ran.get(_file_of(test), 0.0) + seconds
    per_file.update(ran)
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, DURATIONS + ".tmp"), "w") as f:
        json.dump(per_file, f, indent=1, sort_keys=True)
    os.replace(os.path.join(cache, DURATIONS + ".tmp"), os.path.join(cache, DURATIONS))


def _report(groups: list[Group], tests: dict[str, float], total: float) -> int:
    totals: dict[str, int] = {}
    codes: dict[str, list[int]] = {}
    print("\n=== groups (wall time, peak memory of the pytest process):")
    for group in groups:
        codes.setdefault(group.folder, []).append(group.code)
        seconds, gib = group.seconds, group.peak_bytes / 2**30
        print(f"{seconds:7.0f}s {gib:5.1f} GiB  exit {group.code:3d}  {group.describe()}")
        if os.path.exists(group.junit):
            suite = next(ET.parse(group.junit).iter("testsuite"))
            skipped = int(suite.get("skipped", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            totals["passed"] = (
                totals.get("passed", 0) + int(suite.get("tests", 0)) - skipped - failed
            )
            totals["failed"] = totals.get("failed", 0) + failed
    print(f"\n=== the {SLOWEST} slowest tests:")
    for name, seconds in sorted(tests.items(), key=lambda kv: kv[1], reverse=True)[:SLOWEST]:
        print(f"{seconds:7.1f}s  {name}")
    failing = [
        f"{folder} (exit codes {c})"
        for folder, c in codes.items()
        if any(x not in (0, NO_TESTS) for x in c) or all(x == NO_TESTS for x in c)
    ]
    print(f"\n=== total {total:.0f}s ({total / 60:.1f} min) wall")
    summary = ", ".join(f"{totals.get(k, 0)} {k}" for k in ("passed", "failed"))
    print(f"\n{summary}" + (f"; failing: {', '.join(failing)}" if failing else ""))
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
