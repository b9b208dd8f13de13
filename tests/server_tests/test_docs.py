"""README.md and docs/*.md: the code blocks that say they run do, and every relative
link resolves (file, and heading anchor).

A fenced block's info string says whether it runs (docs/testing.md, "Examples that
run"):

  ```python run                   a fresh Python process runs it
  ```bash run                     bash runs it (-e, pipefail), in an empty directory
  ```python run-server [FLAGS]    `jaxserve serve [FLAGS]` is started first (the demo
  ```bash run-server [FLAGS]      model; one server per set of flags, shared), then
                                  the block runs as its client

Every other block is illustrative. A client block is written for the default ports
(localhost:8000 for HTTP, 127.0.0.1:50051 for gRPC); the test serves on free ports and
rewrites those addresses, and a shell block's `curl` fails on an HTTP error
(--fail-with-body). An unknown second word is an error, so that a misspelt marker
cannot leave a block unrun. Blocks run with the test process's environment: its JAX
compilation cache (tests/conftest.py) makes a second run fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODES = ("run", "run-server")
RUNNABLE_LANGS = ("python", "bash")
BIN = Path(sys.executable).parent  # the venv's `jaxserve`, `python`
BLOCK_TIMEOUT_S = 300  # a block, with a cold compilation cache (~90 s on 2 cores)
SERVER_START_S = 300
DEFAULT_ADDRESSES = {"http": ("localhost:8000", "127.0.0.1:8000")}
DEFAULT_ADDRESSES["grpc"] = ("localhost:50051", "127.0.0.1:50051")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # the opening fence's, from 1
    lang: str
    mode: str | None  # None: illustrative
    flags: tuple[str, ...]  # run-server: the server's flags
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def parse(path: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a markdown page, and its other lines (line number, text)."""
    blocks, prose = [], []
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start}: the block is never closed")
        i += 1
        lang = info[0] if info else ""
        mode = info[1] if len(info) > 1 else None
        if mode is not None and (mode not in MODES or lang not in RUNNABLE_LANGS):
            raise ValueError(
                f"{page}:{start}: info string {' '.join(info)!r}: a block that runs is "
                f"{RUNNABLE_LANGS} followed by one of {MODES}"
            )
        if mode != "run-server" and len(info) > 2:
            raise ValueError(f"{page}:{start}: only run-server takes flags, got {info[2:]}")
        blocks.append(Block(page, start, lang, mode, tuple(info[2:]), "\n".join(body) + "\n"))
    return blocks, prose


PARSED = {path: parse(path) for path in PAGES}
RUNNABLE = [b for blocks, _ in PARSED.values() for b in blocks if b.mode is not None]


# ---- links ----------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped (but
    hyphens and underscores), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    prose = PARSED[path][1] if path in PARSED else parse(path)[1]
    for _, line in prose:
        m = HEADING.match(line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
    return {base if i == 0 else f"{base}-{i}" for base, n in seen.items() for i in range(n)}


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in PARSED[path][1]:
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append((number, m.group(2)))
    return found


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(ROOT)}:{number}: ({target})"
        if not dest.exists():
            broken.append(f"{where} no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{where} no heading with anchor #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)


def test_the_parser_finds_links_and_anchors():
    """What the link test relies on (it would pass, vacuously, on a parser finding none)."""
    assert slug("Keys: users, admins, peers") == "keys-users-admins-peers"
    assert slug("Offline: the Python API and `jaxserve generate`") == (
        "offline-the-python-api-and-jaxserve-generate"
    )
    assert slug("Disaggregated prefill/decode") == "disaggregated-prefilldecode"
    readme = links(ROOT / "README.md")
    assert ("docs/offline.md" in {t for _, t in readme}) and len(readme) > 20


def test_every_docs_page_is_linked_from_the_readme():
    targets = {t.partition("#")[0] for _, t in links(ROOT / "README.md")}
    pages = {f"docs/{p.name}" for p in PAGES[1:]}
    assert pages <= targets, f"not linked from README.md: {sorted(pages - targets)}"


def test_ci_runs_the_readme_test_command():
    """`.ci/run` ends with README's test command (after its install), exactly."""
    ci = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln and ln[0] != "#"]
    readme = [b.code.strip() for b in PARSED[ROOT / "README.md"][0] if b.lang == "bash"]
    command = next(c for c in readme if "tools/run_tests.py" in c)
    assert command.endswith("&& " + ci[-1]), (command, ci[-1])


def test_the_promised_examples_run():
    """The quick start's Python API, an OpenAI-client and a gRPC client block run."""
    readme = [b for b in RUNNABLE if b.page == "README.md"]
    assert any(b.mode == "run" and "LLM()" in b.code for b in readme)
    assert any(b.mode == "run-server" and "from openai import" in b.code for b in RUNNABLE)
    assert any(b.mode == "run-server" and "JaxServeStub" in b.code for b in RUNNABLE)


# ---- running the blocks ---------------------------------------------------------------


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    http: int
    grpc: int
    log: Path

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


def start_server(flags: tuple[str, ...], log: Path) -> Server:
    http, grpc = free_port(), free_port()
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")  # the tests' (conftest.py)
    args = [str(BIN / "jaxserve"), "serve", f"--port={http}", f"--grpc_port={grpc}"]
    args += [f"--compilation_cache_dir={cache}", "--drain_grace_s=1", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    server = Server(proc, http, grpc, log)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"jaxserve serve {flags} exited {proc.returncode}:\n{server.tail()}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{http}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise AssertionError(f"jaxserve serve {flags} was not serving after {SERVER_START_S} s")


def stop_server(server: Server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """flags -> a serving `jaxserve serve`, started on first use, stopped at the end."""
    started: dict[tuple[str, ...], Server] = {}

    def get(flags: tuple[str, ...]) -> Server:
        if flags not in started:
            log = tmp_path_factory.mktemp("server") / "serve.log"
            started[flags] = start_server(flags, log)
        assert started[flags].proc.poll() is None, started[flags].tail()
        return started[flags]

    yield get
    for server in started.values():
        stop_server(server)


def for_server(code: str, server: Server) -> str:
    """The block with the default addresses replaced by the test server's."""
    named = False
    for kind, port in (("http", server.http), ("grpc", server.grpc)):
        for address in DEFAULT_ADDRESSES[kind]:
            named |= address in code
            code = code.replace(address, f"127.0.0.1:{port}")
    assert named, "a run-server block names no server address (localhost:8000, :50051)"
    return code


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_block_runs(block, servers, tmp_path):
    code = block.code
    if block.mode == "run-server":
        code = for_server(code, servers(block.flags))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    if block.lang == "python":
        args = [sys.executable, "-c", code]
    else:
        curl = 'curl() { command curl --fail-with-body "$@"; }\n'
        args = ["bash", "-e", "-o", "pipefail", "-c", curl + code]
    try:
        proc = subprocess.run(
            args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{block.name} ran past {BLOCK_TIMEOUT_S} s:\n{e.stderr}") from None
    output = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"{block.name} exited {proc.returncode}:\n{output}"
