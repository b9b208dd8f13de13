"""`jaxserve bench`: workloads, statistics, and both modes end to end on a tiny model."""

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from jaxserve.bench import report, workloads


def test_workloads_are_seeded_and_in_range():
    a = workloads.random_workload(50, input_len=100, output_len=40, range_ratio=0.5, vocab=300)
    b = workloads.random_workload(50, input_len=100, output_len=40, range_ratio=0.5, vocab=300)
    assert a == b
    assert all(50 <= len(r.prompt_token_ids) <= 150 and 20 <= r.max_tokens <= 60 for r in a)
    assert all(16 <= t < 300 for r in a for t in r.prompt_token_ids)
    share = workloads.sharegpt_like(200, vocab=300, max_len=1024)
    lens = sorted(len(r.prompt_token_ids) for r in share)
    assert lens[0] >= 4 and lens[-1] <= 512 and lens[-1] > 2 * lens[100]  # a long tail
    prefix = workloads.shared_prefix(
        8, num_prefixes=2, prefix_len=20, suffix_len=5, output_len=3, vocab=300
    )
    assert prefix[0].prompt_token_ids[:20] == prefix[2].prompt_token_ids[:20]
    assert prefix[0].prompt_token_ids[:20] != prefix[1].prompt_token_ids[:20]


def test_grounded_prompts_quote_real_text():
    from jaxserve.llm import resolve_model_dir
    from jaxserve.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_dir(None))
    passages = workloads.passages_from_python_docs(tok.encode, min_tokens=100)
    reqs = workloads.grounded(
        6,
        passages=passages,
        instruction=[1, 2],
        separator=[3],
        input_len=100,
        output_len=50,
        seed=1,
    )
    for r in reqs:
        ids = r.prompt_token_ids
        passage = ids[2:102]
        assert ids[:2] == [1, 2] and ids[102] == 3 and ids[103:] == passage[:8]
        assert r.max_tokens == 50
    assert "the" in tok.decode(reqs[0].prompt_token_ids[2:102])  # English prose


def test_summarize():
    s = report.summarize([0.001 * i for i in range(1, 101)])
    assert s["median"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert report.summarize([]) == {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}


def test_bench_without_matplotlib_prints_its_tables_and_skips_the_plot(tmp_path):
    """matplotlib is in the `bench` extra only: a plain install's bench used to end its
    run in a ModuleNotFoundError traceback, before the table was printed."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    path = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "bench", "--model=demo-model-tiny"]
        + ["--mode=offline", "--num_requests=4", "--input_len=16", "--output_len=4"]
        + ["--max_model_len=64", "--max_num_batched_tokens=64", "--max_num_seqs=4"]
        + ["--block_size=8", "--warmup=false", "--compilation_cache_dir="]
        + [f"--output_json={out}", f"--output_png={png}"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "requests/s" in proc.stdout and "TTFT mean/median/p90/p99" in proc.stdout
    skipped = [line for line in proc.stdout.splitlines() if "plot skipped" in line]
    assert len(skipped) == 1 and "pip install -e '.[bench]'" in skipped[0], proc.stdout
    assert proc.stdout.index("requests/s") < proc.stdout.index("plot skipped")
    assert json.loads(out.read_text())["runs"]["run"]["requests"] == 4
    assert not png.exists() and f"plot: {png}" not in proc.stdout


def test_the_http_bench_client_is_an_install_dependency():
    """`jaxserve bench --target_protocol=http` crashed on a plain install: httpx was only
    in the `bench` extra. It is small and pure Python; matplotlib, heavy, stays optional."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group().lower() for d in project["dependencies"]}
    assert "httpx" in names
    assert (
        "matplotlib" not in names and "matplotlib>=3.8" in project["optional-dependencies"]["bench"]
    )


def _bench(tmp_path, *args):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli.main",
            "bench",
            *args,
            f"--output_json={out}",
            f"--output_png={png}",
            "--warmup=false",
            "--max_model_len=256",
            "--max_num_batched_tokens=128",
            "--max_num_seqs=8",
            "--block_size=8",
            "--compilation_cache_dir=",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.stat().st_size > 1000
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_offline_shared_prefix_with_and_without_caching(tiny_model_dir, tmp_path):
    result, stdout = _bench(
        tmp_path,
        f"--model={tiny_model_dir}",
        "--mode=offline",
        "--workload=shared-prefix",
        "--num_requests=12",
        "--prefix_len=64",
        "--suffix_len=8",
        "--output_len=4",
        "--compare_prefix_caching",
    )
    on, off = result["runs"]["prefix caching on"], result["runs"]["prefix caching off"]
    assert on["requests"] == off["requests"] == 12
    assert on["engine"]["prefix_cache_hit_rate"] > 0.5 > off["engine"]["prefix_cache_hit_rate"]
    assert on["output_tokens_per_s"] > 0 and on["ttft_ms"]["p99"] >= on["ttft_ms"]["median"]
    assert 0 <= on["engine"]["host_overhead_frac"] <= 1
    assert 0 <= on["engine"]["kv_waste_at_peak_frac"] < 1
    assert "mean TTFT, caching off / on" in stdout


@pytest.mark.slow
def test_offline_over_data_parallel_replicas_on_ray(tiny_model_dir, tmp_path):
    """The offline mode streams through the data-parallel front (it has no add_request)."""
    pytest.importorskip("ray")
    result, _ = _bench(
        tmp_path,
        f"--model={tiny_model_dir}",
        "--mode=offline",
        "--num_requests=8",
        "--input_len=16",
        "--output_len=6",
        "--data_parallel_size=2",
        "--data_parallel_backend=ray",
    )
    assert result["device"] == "Ray replicas"  # the front took no device of its own
    run = result["runs"]["run"]
    assert run["requests"] == 8 and run["output_tokens_per_s"] > 0
    assert run["engine"]["steps"] > 0 and run["ttft_ms"]["p99"] >= run["ttft_ms"]["median"]


@pytest.mark.slow
def test_offline_grounded_with_ngram_speculation_reports_acceptance(tmp_path):
    result, stdout = _bench(
        tmp_path,
        "--mode=offline",
        "--workload=grounded",
        "--num_requests=3",
        "--input_len=64",
        "--output_len=24",
        "--speculative_method=ngram",
        "--num_speculative_tokens=3",
    )
    run = result["runs"]["run"]
    engine = run["engine"]
    assert engine["spec_decode_draft_tokens"] > 0
    assert engine["spec_decode_mean_acceptance_length"] > 1.0
    # TPOT is per token, though a step may bring several: over a request's 23 tokens
    # after the first it adds up to its time after the first token.
    after_first = run["e2e_ms"]["mean"] - run["ttft_ms"]["mean"]
    assert run["tpot_ms"]["mean"] * 23 == pytest.approx(after_first, rel=1e-3)
    assert "spec_decode_mean_acceptance_length" in stdout


@pytest.mark.slow
def test_serving_mode_with_goodput(tiny_model_dir, tmp_path):
    result, stdout = _bench(
        tmp_path,
        f"--model={tiny_model_dir}",
        "--mode=serving",
        "--workload=random",
        "--num_requests=10",
        "--input_len=20",
        "--output_len=6",
        "--range_ratio=0.5",
        "--request_rate=50",
        "--goodput=ttft:60000,tpot:60000",
    )
    run = result["runs"]["run"]
    assert run["requests"] == 10 and run["goodput"]["good_requests"] == 10
    assert run["tpot_ms"]["mean"] > 0 and run["itl_ms"]["median"] > 0
    assert "TTFT mean/median/p90/p99" in stdout


@pytest.mark.slow
def test_target_mode_asks_the_server_for_its_limits(tiny_model_dir, tmp_path):
    """Against a running server the workload fits the server's own vocabulary (320
    here) and max_model_len (128), from GetModelInfo; it used to assume 32000 / 2048."""
    from conftest import ServerThread

    server = ServerThread(tiny_model_dir)
    try:
        result, _ = _bench(
            tmp_path,
            f"--target={server.target}",
            "--mode=serving",
            "--workload=random",
            "--num_requests=6",
            "--input_len=24",
            "--output_len=4",
        )
        assert result["runs"]["run"]["requests"] == 6
        too_long = subprocess.run(
            [sys.executable, "-m", "server.cli.main", "bench", f"--target={server.target}"]
            + ["--mode=serving", "--input_len=200", "--output_len=4", "--output_png="]
            + [f"--output_json={tmp_path / 'x.json'}"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert too_long.returncode != 0
        assert "max_model_len is 128" in too_long.stderr, too_long.stderr[-2000:]
    finally:
        server.stop()


@pytest.mark.slow
def test_serving_over_http(tiny_model_dir, tmp_path):
    """--target_protocol=http streams from /v1/completions; the limits come from /v1/models."""
    from conftest import ServerThread

    server = ServerThread(tiny_model_dir, http_port=0)
    try:
        result, _ = _bench(
            tmp_path,
            f"--target=127.0.0.1:{server.server.http_port}",
            "--target_protocol=http",
            "--mode=serving",
            "--workload=random",
            "--num_requests=6",
            "--input_len=24",
            "--output_len=5",
            "--max_concurrency=3",
        )
        run = result["runs"]["run"]
        assert run["requests"] == 6 and run["output_tokens_per_s"] > 0
        assert run["itl_ms"]["median"] > 0 and result["config"]["target_protocol"] == "http"
        assert server.engine.stats().generation_tokens >= 6 * 5
    finally:
        server.stop()


@pytest.mark.slow
def test_serving_compares_sync_and_async_scheduling(tiny_model_dir, tmp_path):
    result, stdout = _bench(
        tmp_path,
        f"--model={tiny_model_dir}",
        "--mode=serving",
        "--workload=random",
        "--num_requests=8",
        "--input_len=20",
        "--output_len=6",
        "--compare_async_scheduling",
    )
    sync, asyn = result["runs"]["sync scheduling"], result["runs"]["async scheduling"]
    assert sync["requests"] == asyn["requests"] == 8
    assert result["output_throughput_ratio_async_over_sync"] > 0
    assert "async / sync scheduling" in stdout
