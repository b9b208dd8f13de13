"""benchmarks/device_bench.py, the prepared GPU benchmark, run whole on the CPU at
--smoke sizes with the tiny Llama shape: every section writes its JSON with numbers
(a GPU may be lent only once; the script has to work the first time there), and the
trace reduction it uses is exact on a trace built by hand."""

import gzip
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from device_bench import SECTIONS  # noqa: E402
from device_kernels import sig  # noqa: E402
from trace_summary import summarize  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_bench")
    command = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "device_bench.py"),
        f"--out={out / 'out'}",
        f"--work_dir={out / 'work'}",
        "--shape=tiny",
        "--smoke",
        "--budget_s=240",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    sections = {}
    for name in SECTIONS:
        with open(out / "out" / f"{name}.json") as f:
            sections[name] = json.load(f)
    return out / "out", sections, run.stdout


def test_every_section_ran_and_names_the_machine(results):
    _, sections, stdout = results
    for name, data in sections.items():
        status = data["status"]
        if name == "torch_fallback" and status.startswith("skipped"):
            continue  # no torch here
        assert status == "ok", (name, status, data.get("traceback"))
        assert data["machine"]["device"] and data["machine"]["cpu"]
        assert "--shape=tiny" in data["command"]
        assert f"{name}: ok" in stdout  # the progress log names it


def test_probe_numbers(results):
    probe = results[1]["probe"]
    assert probe["copy_GB_s"] > 0 and probe["read_GB_s"] > 0
    assert probe["bandwidth_GB_s"] == max(probe["copy_GB_s"], probe["read_GB_s"])
    assert probe["matmul_TFLOP_s"] > 0
    assert probe["jax_version"]


def test_decode_rows(results):
    decode = results[1]["llama8b_decode"]
    assert decode["model"]["weights"].startswith("make_model.write_streamed")
    rows = decode["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["status"] == "ok"
        assert row["running"] == row["batch"]  # none finished inside the timed steps
        assert row["prompt_tokens_in_timed_steps"] == 0  # decode only
        assert row["ms_per_step"] > 0 and row["host_ms_per_step"] > 0
        assert 0 < row["host_share"] < 1
        assert row["output_tok_s"] > 0
        # every running sequence's prompt and more: context 64 in --smoke
        assert row["kv_tokens_read_per_step"] > 64 * row["batch"]
        assert row["MBU"] > 0


def test_prefill_profile_demo_torch(results):
    out, sections, _ = results
    prefill = sections["llama8b_prefill"]
    assert prefill["steps_per_prompt"] == 1  # one 128-token prompt, a 128-token budget
    assert prefill["TFLOP_s"] > 0 and prefill["MFU"] > 0
    profile = sections["profile"]
    assert profile["steps_traced"] == 2 and profile["batch"] == 2
    assert profile["per_step"]["step_ms"] > 0 and profile["per_step"]["kernel_busy_ms"] > 0
    assert (out / profile["trace_file"]).exists()
    demo = sections["demo_batch1"]
    assert demo["batch"] == 1 and demo["ms_per_step"] > 0
    torch = sections["torch_fallback"]
    if torch["status"] == "ok":
        assert [r["batch"] for r in torch["rows"]] == [1, 2]
        assert all(r["output_tok_s"] > 0 for r in torch["rows"])
    # what a device call brings back: at most 8 files (README's command archives them)
    assert len(os.listdir(out)) <= 8


def test_attention_sweep_rows(results):
    sweep = results[1]["attention_sweep"]
    rows = sweep["rows"]
    assert [r["default"] for r in rows] == [True, False]  # (--smoke: the first 2 settings)
    # each page size's pick first: pages of 16 (the engine's), then of 32, the same tokens
    assert [(r["page_size"], r["pick"]) for r in rows] == [(16, True), (32, True)]
    assert all(r["batch"] == 2 and r["us"] > 0 and r["GB_s"] > 0 for r in rows)
    assert rows[0]["max_diff"] == 0.0 and rows[1]["max_diff"] < 0.05  # (bfloat16 out)
    tiles = sweep["default_tiles"]
    assert [t["page_size"] for t in tiles] == [16, 32, 64, 128]
    assert sweep["best_batch_2"] in rows and all(t["block_kv"] >= 16 for t in tiles)


def test_trace_summary_by_hand(tmp_path):
    """Two steps of 100 us; kernels on a GPU stream (an overlap counted once, a
    derived 'XLA Ops' line ignored) and host spans that are not kernels."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": 2, "tid": 20, "name": "thread_name", "args": {"name": "Stream #7"}},
        {"ph": "M", "pid": 2, "tid": 21, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]

    def span(tid, pid, ts, dur, name):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}

    events = [
        span(10, 1, 0, 100, "decode_step"),
        span(10, 1, 5, 10, "dispatch"),
        span(20, 2, 20, 30, "gemm"),  # 20-50
        span(20, 2, 40, 20, "gemm"),  # 40-60: overlaps, busy 20-60
        span(20, 2, 75, 15, "attention"),  # 75-90: a 15 us gap before it
        span(21, 2, 20, 70, "fusion"),  # derived line: not counted
        span(10, 1, 200, 100, "decode_step"),
        span(20, 2, 210, 80, "gemm"),  # 210-290
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    s = summarize(str(path), "decode_step")
    assert s["steps_traced"] == 2
    assert s["kernel_lines"] == "device streams" and s["kernel_line_names"] == ["Stream #7"]
    per = s["per_step"]
    assert per["step_ms"] == pytest.approx(0.1)
    assert per["kernel_busy_ms"] == pytest.approx((55 + 80) / 2 / 1e3)
    assert per["host_lead_ms"] == pytest.approx((20 + 10) / 2 / 1e3)
    assert per["host_tail_ms"] == pytest.approx((10 + 10) / 2 / 1e3)
    assert per["between_kernels_ms"] == pytest.approx(15 / 2 / 1e3)
    assert per["idle_ms"] == pytest.approx((45 + 20) / 2 / 1e3)
    assert per["kernels"] == 2.0 and per["gaps_over_10us"] == 0.5
    assert s["largest_gap_us"] == 15
    assert s["top_kernels_ms_per_step"] == pytest.approx(
        {"gemm": (30 + 20 + 80) / 2 / 1e3, "attention": 15 / 2 / 1e3}
    )


def test_rates_keep_three_significant_figures():
    """A slow machine's smoke-run rates stay above 0 (the sweep's GB/s, rounded to one
    decimal, read 0.0 on CI's machine and failed the test above)."""
    assert sig(0.0123456) == 0.0123 and sig(2e-9) == 2e-9 and sig(123456.7) == 123000.0
    assert sig(0.0) == 0.0
