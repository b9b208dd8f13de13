"""`jaxserve bench`: throughput and latency benchmarks, as vLLM's `bench` reports them.

  jaxserve bench --mode=offline --workload=random --num_requests=128
  jaxserve bench --mode=offline --workload=shared-prefix --compare_prefix_caching
  jaxserve bench --mode=serving --workload=shared-prefix --compare_kv_offload --num_kv_pages=80
  jaxserve bench --mode=serving --request_rate=4 --goodput=ttft:500,tpot:100
  jaxserve bench --mode=serving --target=host:50051     # against a running server
  jaxserve bench --mode=serving --target_protocol=http  # over the OpenAI HTTP API
  jaxserve bench --roofline                             # batch-1 decode vs bandwidth

Offline mode submits every request at once to an engine and steps it to the
end; serving mode streams them from a server (started in-process unless
--target is given) over gRPC or, with --target_protocol=http, the OpenAI HTTP
API, at a Poisson rate or a fixed concurrency. Both report request and token
throughput and per-request TTFT, TPOT (time per output token after the first),
inter-token latency and end-to-end latency (mean, median, p90, p99), plus the
engine's own figures: host overhead per step, KV waste at peak, preemptions and
the prefix-cache hit rate. Results go to a JSON file and a table to the terminal,
then a PNG of latency CDFs if matplotlib is installed (the `bench` extra:
`pip install -e '.[bench]'`; without it one line says the plot was skipped).
"""

from __future__ import annotations

import asyncio
import logging
import time

import jax
import numpy as np
from absl import flags
from tqdm import tqdm

from jaxserve.bench import report, workloads
from jaxserve.distributed.data_parallel import DataParallelEngine, stream_all
from jaxserve.generate_request import GenerateRequest
from jaxserve.llm import LLM, resolve_model_dir
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tokenizer import Tokenizer
from server.cli import bench_clients, logs
from server.cli.engine_flags import engine_kwargs

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "offline", ["offline", "serving"], "What to measure.")
flags.DEFINE_enum(
    "workload",
    "random",
    ["random", "sharegpt", "shared-prefix", "grounded"],
    "Requests ('grounded': repeat a passage of real text, tokenized with --model's "
    "tokenizer; the case n-gram speculation is for).",
)
flags.DEFINE_integer("num_requests", 64, "Requests in the workload.")
flags.DEFINE_integer("input_len", 128, "random: mean prompt length.")
flags.DEFINE_integer("output_len", 64, "random / shared-prefix: mean output length.")
flags.DEFINE_float("range_ratio", 0.0, "random: lengths vary by +- this fraction.")
flags.DEFINE_integer("num_prefixes", 4, "shared-prefix: distinct system prompts.")
flags.DEFINE_integer("prefix_len", 256, "shared-prefix: system prompt length.")
flags.DEFINE_integer("suffix_len", 32, "shared-prefix: per-request suffix length.")
flags.DEFINE_bool("ignore_eos", True, "Generate exactly the requested number of tokens.")
flags.DEFINE_integer("bench_seed", 0, "Workload seed.")
flags.DEFINE_bool("compare_prefix_caching", False, "Run twice, caching on and off.")
flags.DEFINE_bool(
    "compare_async_scheduling",
    False,
    "Run twice, synchronous then asynchronous scheduling (--async_scheduling ignored).",
)
flags.DEFINE_bool(
    "compare_kv_offload",
    False,
    "Run twice, with the host KV tier (--kv_offload_bytes, default 1 GiB) and without.",
)
flags.DEFINE_bool("roofline", False, "Measure batch-1 decode against memory bandwidth.")
flags.DEFINE_string("target", None, "serving: address of a running server (host:port).")
flags.DEFINE_enum(
    "target_protocol",
    "grpc",
    list(bench_clients.PROTOCOLS),
    "serving: stream over gRPC (Generate) or the OpenAI HTTP API (/v1/completions).",
)
flags.DEFINE_float("request_rate", float("inf"), "serving: Poisson arrival rate (req/s).")
flags.DEFINE_integer("max_concurrency", None, "serving: most requests in flight.")
flags.DEFINE_string("goodput", None, "SLOs in ms, e.g. ttft:500,tpot:100,e2e:5000.")
flags.DEFINE_string("output_json", "bench_result.json", "Where the results go.")
flags.DEFINE_string(
    "output_png", "bench_result.png", "Latency CDF plot ('' for none; needs matplotlib)."
)


def _workload(vocab: int, max_len: int) -> list[workloads.BenchRequest]:
    """The requests, checked against the model's vocabulary and max_model_len."""
    reqs = _make_workload(vocab, max_len)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    if longest > max_len:
        raise SystemExit(
            f"jaxserve bench: a {FLAGS.workload} request needs {longest} tokens (prompt + "
            f"output); the model's max_model_len is {max_len}: lower the lengths"
        )
    return reqs


def _make_workload(vocab: int, max_len: int) -> list[workloads.BenchRequest]:
    n, seed = FLAGS.num_requests, FLAGS.bench_seed
    if FLAGS.workload == "random":
        return workloads.random_workload(
            n,
            input_len=FLAGS.input_len,
            output_len=FLAGS.output_len,
            range_ratio=FLAGS.range_ratio,
            vocab=vocab,
            seed=seed,
        )
    if FLAGS.workload == "sharegpt":
        return workloads.sharegpt_like(n, vocab=vocab, max_len=max_len, seed=seed)
    if FLAGS.workload == "grounded":
        tokenizer = Tokenizer(resolve_model_dir(FLAGS.tokenizer or FLAGS.model))
        return workloads.grounded(
            n,
            passages=workloads.passages_from_python_docs(
                tokenizer.encode, min_tokens=FLAGS.input_len
            ),
            instruction=tokenizer.encode("Repeat the following passage exactly.\n\n"),
            separator=tokenizer.encode("\n\nThe passage, repeated:\n\n"),
            input_len=FLAGS.input_len,
            output_len=FLAGS.output_len,
            seed=seed,
        )
    return workloads.shared_prefix(
        n,
        num_prefixes=FLAGS.num_prefixes,
        prefix_len=FLAGS.prefix_len,
        suffix_len=FLAGS.suffix_len,
        output_len=FLAGS.output_len,
        vocab=vocab,
        seed=seed,
    )


def _latencies(arrive, first, ends, token_times) -> dict:
    ttft = [first[i] - arrive[i] for i in ends]
    e2e = [ends[i] - arrive[i] for i in ends]
    tpot = [
        (ends[i] - first[i]) / (len(token_times[i]) - 1) for i in ends if len(token_times[i]) > 1
    ]
    itl = [b - a for i in ends for a, b in zip(token_times[i], token_times[i][1:], strict=False)]
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}


def _goodput(arrive, first, ends, token_times, elapsed: float) -> dict | None:
    """Requests (per second) that met every SLO given in --goodput."""
    if not FLAGS.goodput:
        return None
    slos = {k: float(v) / 1e3 for k, v in (p.split(":") for p in FLAGS.goodput.split(","))}
    good = 0
    for i in ends:
        n = len(token_times[i])
        measured = {
            "ttft": first[i] - arrive[i],
            "e2e": ends[i] - arrive[i],
            "tpot": (ends[i] - first[i]) / (n - 1) if n > 1 else 0.0,
        }
        good += all(measured[k] <= slo for k, slo in slos.items())
    return {
        "slos_ms": {k: v * 1e3 for k, v in slos.items()},
        "good_requests": good,
        "goodput_req_s": good / elapsed,
    }


def _run_offline(llm: LLM, reqs) -> dict:
    engine = llm.engine
    base = engine.stats()
    arrive, first, ends, token_times = {}, {}, {}, {}
    t0 = time.perf_counter()
    requests = [
        GenerateRequest(
            str(i),
            r.prompt_token_ids,
            SamplingParams(
                temperature=0.0,
                max_tokens=r.max_tokens,
                ignore_eos=FLAGS.ignore_eos,
                output_kind=RequestOutputKind.DELTA,  # (`record` reads the new tokens)
            ),
        )
        for i, r in enumerate(reqs)
    ]
    for i in range(len(reqs)):
        arrive[i], token_times[i] = t0, []

    def record(out) -> None:
        now, i = time.perf_counter(), int(out.request_id)
        # One time per token: a step may bring several (accepted speculative drafts).
        token_times[i].extend([now] * max(1, len(out.outputs[0].delta_token_ids)))
        first.setdefault(i, now)
        if out.finished:
            ends[i] = now

    with tqdm(total=len(reqs), desc="offline", unit="req", mininterval=2) as bar:
        if isinstance(engine, DataParallelEngine):  # all at once through the router

            def record_one(i: int, out) -> None:
                record(out)
                if out.finished:
                    bar.update(1)

            stream_all(engine, requests, record_one)
        else:
            for request in requests:
                engine.add_request(request)
            engine.run(record, progress=bar)
    elapsed = time.perf_counter() - t0
    return _result(reqs, arrive, first, ends, token_times, elapsed, engine.stats(), base)


def _result(reqs, arrive, first, ends, token_times, elapsed, stats, base) -> dict:
    lat = _latencies(arrive, first, ends, token_times)
    out_tokens = {i: reqs[i].max_tokens if FLAGS.ignore_eos else len(token_times[i]) for i in ends}
    in_tokens = sum(len(reqs[i].prompt_token_ids) for i in ends)
    result = {
        "requests": len(ends),
        "elapsed_s": elapsed,
        "request_throughput": len(ends) / elapsed,
        "input_tokens_per_s": in_tokens / elapsed,
        "output_tokens_per_s": sum(out_tokens.values()) / elapsed,
        **{f"{k}_ms": report.summarize(v) for k, v in lat.items()},
        "goodput": _goodput(arrive, first, ends, token_times, elapsed),
    }
    if stats is not None:
        host = stats.host_seconds - base.host_seconds
        device = stats.device_seconds - base.device_seconds
        hits = stats.prefix_cache_hits - base.prefix_cache_hits
        queries = stats.prefix_cache_queries - base.prefix_cache_queries
        result["engine"] = {
            "steps": stats.steps - base.steps,
            "step_ms_mean": 1e3 * elapsed / max(1, stats.steps - base.steps),
            "host_overhead_frac": host / (host + device) if host + device else 0.0,
            "kv_waste_at_peak_frac": stats.kv_waste_at_peak,
            "peak_kv_pages": stats.peak_kv_pages,
            "preemptions": stats.num_preemptions - base.num_preemptions,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "compilations_during_run": stats.num_compiles - base.num_compiles,
        }
        drafts = stats.spec_decode_num_drafts - base.spec_decode_num_drafts
        if drafts:
            accepted = stats.spec_decode_num_accepted_tokens - base.spec_decode_num_accepted_tokens
            draft_tokens = stats.spec_decode_num_draft_tokens - base.spec_decode_num_draft_tokens
            result["engine"].update(
                spec_decode_drafts=drafts,
                spec_decode_draft_tokens=draft_tokens,
                spec_decode_accepted_tokens=accepted,
                spec_decode_acceptance_rate=accepted / draft_tokens,
                spec_decode_mean_acceptance_length=1.0 + accepted / drafts,
            )
    result["_latencies"] = lat
    return result


async def _serving(target: str, reqs) -> dict:
    arrive, first, ends, token_times = {}, {}, {}, {}
    limit = asyncio.Semaphore(FLAGS.max_concurrency or len(reqs))
    rs = np.random.RandomState(FLAGS.bench_seed)

    async def one(stream, i, r):
        async with limit:
            arrive[i], token_times[i] = time.perf_counter(), []
            async for n in stream(f"bench-{i}", r.prompt_token_ids, r.max_tokens, FLAGS.ignore_eos):
                now = time.perf_counter()
                token_times[i].extend([now] * n)
                first.setdefault(i, now)
            ends[i] = time.perf_counter()

    async with bench_clients.open_client(FLAGS.target_protocol, target) as stream:
        t0 = time.perf_counter()
        tasks = []
        for i, r in enumerate(reqs):
            tasks.append(asyncio.create_task(one(stream, i, r)))
            if np.isfinite(FLAGS.request_rate):
                await asyncio.sleep(rs.exponential(1.0 / FLAGS.request_rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return _result(reqs, arrive, first, ends, token_times, elapsed, None, None)


def _serve_in_process(model_dir: str, kwargs: dict):
    """Starts a server on a free loopback port in a background thread; returns it."""
    import threading

    from server.app import JaxServeServer, ServerOptions

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def make_engine():
        llm = LLM(model_dir, **kwargs)
        return llm.engine, llm.tokenizer

    async def start():
        http_port = 0 if FLAGS.target_protocol == "http" else None
        options = ServerOptions(grpc_port=0, http_port=http_port)
        server = JaxServeServer(make_engine, options, model_name="bench")
        await server.start()
        await server.load()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result()
    return server, loop


def _device_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth of the default device (GPU, TPU) in bytes/s: the best of
    `repeats` reductions over a `num_bytes` array."""
    x = jax.numpy.ones(num_bytes // 4, jax.numpy.float32)
    total = jax.jit(jax.numpy.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def _roofline(llm: LLM) -> dict:
    """Batch-1 decode step time against the bytes a step must read.

    The bandwidth is probed before and after the decode and the higher reading
    kept: on a shared machine one probe can read low, which would overstate the
    utilization.
    """
    probe = report.memory_bandwidth if jax.default_backend() == "cpu" else _device_bandwidth
    probes = [probe()]
    engine = llm.engine
    weights = engine.model_info().weight_bytes
    engine.add_request(
        GenerateRequest(
            "roofline",
            tuple(range(16, 48)),
            SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True),
        )
    )
    # One output per step (one request): the gaps between outputs are decode steps.
    times = []
    engine.run(lambda out: times.append(time.perf_counter()))
    step = float(np.median(np.diff(times)))
    probes.append(probe())
    bandwidth = max(probes)
    # every layer's K and V of one token, scales of a quantized cache included
    kv_token = llm.config.kv_bytes_per_page() / llm.config.cache.page_size
    kv = kv_token * (32 + 32)  # the average kv length over the decode
    moved = weights + kv
    return {
        "memory_bandwidth_GB_s": bandwidth / 1e9,
        "memory_bandwidth_low_probe_GB_s": min(probes) / 1e9,
        "weights_MB": weights / 1e6,
        "decode_step_ms": step * 1e3,
        "decode_tokens_per_s": 1.0 / step,
        "bytes_per_step_MB": moved / 1e6,
        "model_bandwidth_utilization": moved / step / bandwidth,
    }


def main(argv) -> None:
    del argv
    logs.configure(logging.WARNING)
    model_dir = resolve_model_dir(FLAGS.model)
    kwargs = engine_kwargs()
    result = {
        "config": {
            k: FLAGS[k].value
            for k in (
                "mode",
                "workload",
                "num_requests",
                "input_len",
                "output_len",
                "range_ratio",
                "num_prefixes",
                "prefix_len",
                "suffix_len",
                "ignore_eos",
                "request_rate",
                "max_concurrency",
                "target_protocol",
                "model",
                "max_num_seqs",
                "max_num_batched_tokens",
                "dtype",
            )
        },
        # Ray replicas hold the devices: this process must not take one (a GPU's memory).
        "device": (
            "Ray replicas"
            if kwargs.get("data_parallel_backend") == "ray"
            else jax.devices()[0].device_kind
        ),
        "date": time.strftime("%Y-%m-%d"),
    }
    runs = {}
    if FLAGS.roofline:
        with LLM(model_dir, **{**kwargs, "warmup": False}) as llm:
            result["roofline"] = _roofline(llm)
    variants = [("", {})]
    if FLAGS.compare_prefix_caching:
        variants = [
            ("prefix caching on", {"enable_prefix_caching": True}),
            ("prefix caching off", {"enable_prefix_caching": False}),
        ]
    elif FLAGS.compare_async_scheduling:
        variants = [
            ("sync scheduling", {"async_scheduling": False}),
            ("async scheduling", {"async_scheduling": True}),
        ]
    elif FLAGS.compare_kv_offload:
        tier = kwargs["kv_offload_bytes"] or 1 << 30
        variants = [
            ("kv tier on", {"kv_offload_bytes": tier}),
            (
                "kv tier off",
                {"kv_offload_bytes": 0, "kv_offload_dir": None, "kv_tier_disk_max_bytes": None},
            ),
        ]
    for label, overrides in variants:
        run_kwargs = {**kwargs, **overrides}
        if FLAGS.mode == "offline":
            llm = LLM(model_dir, **run_kwargs)
            reqs = _workload(llm.config.model.vocab_size, llm.config.max_model_len)
            runs[label or "run"] = _run_offline(llm, reqs)
            # Released before the next variant's engine; replicas (local threads, Ray
            # actors) stop here, not in the interpreter's exit, where Ray's worker may
            # already be gone (the run then exited 1).
            llm.close()
        else:
            server = loop = None
            target = FLAGS.target
            if target is None:
                server, loop = _serve_in_process(model_dir, run_kwargs)
                port = server.http_port if FLAGS.target_protocol == "http" else server.grpc_port
                target = f"127.0.0.1:{port}"
            vocab, max_len = asyncio.run(bench_clients.model_limits(FLAGS.target_protocol, target))
            reqs = _workload(vocab, max_len)
            runs[label or "run"] = asyncio.run(_serving(target, reqs))
            if server is not None:
                asyncio.run_coroutine_threadsafe(server.stop(grace=1), loop).result()
    latencies = {name: r.pop("_latencies") for name, r in runs.items()}
    result["runs"] = runs
    if FLAGS.compare_prefix_caching or FLAGS.compare_kv_offload:
        on, off = (runs[label] for label, _ in variants)
        result["ttft_mean_ratio_off_over_on"] = off["ttft_ms"]["mean"] / on["ttft_ms"]["mean"]
    if FLAGS.compare_async_scheduling:
        sync, asyn = runs["sync scheduling"], runs["async scheduling"]
        result["output_throughput_ratio_async_over_sync"] = (
            asyn["output_tokens_per_s"] / sync["output_tokens_per_s"]
        )
    report.save_json(FLAGS.output_json, result)
    _print_tables(result)
    # The plot comes last: matplotlib is an extra ([bench]); without it the tables
    # above are the report.
    plotted = bool(FLAGS.output_png) and _plot(FLAGS.output_png, latencies)
    print(f"\nresults: {FLAGS.output_json}" + (f", plot: {FLAGS.output_png}" if plotted else ""))


def _print_tables(result: dict) -> None:
    for name, r in result["runs"].items():
        rows = [
            ("requests/s", f"{r['request_throughput']:.2f}"),
            ("input tokens/s", f"{r['input_tokens_per_s']:.1f}"),
            ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ]
        for metric in ("ttft", "tpot", "itl", "e2e"):
            s = r[f"{metric}_ms"]
            rows.append(
                (
                    f"{metric.upper()} mean/median/p90/p99 (ms)",
                    f"{s['mean']:.1f} / {s['median']:.1f} / {s['p90']:.1f} / {s['p99']:.1f}",
                )
            )
        if r.get("goodput"):
            rows.append(("goodput (req/s)", f"{r['goodput']['goodput_req_s']:.2f}"))
        for key, value in (r.get("engine") or {}).items():
            rows.append((key, f"{value:.4f}" if isinstance(value, float) else str(value)))
        report.print_table(f"{FLAGS.mode} {FLAGS.workload} {name}", rows)
    if "roofline" in result:
        report.print_table(
            "batch-1 decode roofline", [(k, f"{v:.3f}") for k, v in result["roofline"].items()]
        )
    if "ttft_mean_ratio_off_over_on" in result:
        what = "KV tier" if FLAGS.compare_kv_offload else "caching"
        print(f"\nmean TTFT, {what} off / on: {result['ttft_mean_ratio_off_over_on']:.2f}x")
    if "output_throughput_ratio_async_over_sync" in result:
        ratio = result["output_throughput_ratio_async_over_sync"]
        print(f"\noutput tokens/s, async / sync scheduling: {ratio:.3f}x")


def _plot(path: str, latencies: dict) -> bool:
    """Writes the latency CDFs to `path`; False, saying so in one line, without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("\nplot skipped: matplotlib is not installed (pip install -e '.[bench]' adds it)")
        return False
    runs_series = {
        name: {k.upper(): lat[k] for k in ("ttft", "tpot", "e2e")}
        for name, lat in latencies.items()
    }
    report.plot_latency_cdfs(path, runs_series, f"jaxserve {FLAGS.mode} / {FLAGS.workload}")
    return True
