"""The measurements of `device_bench.py` (its docstring says what each is): each
section a function that fills its `Section` (a JSON file in OUT, rewritten after each
piece), sized by a `Plan`. JAX and jaxserve are imported inside the sections:
each group of them runs in a process of its own.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shutil
import time
import traceback

from device_kernels import sig
from host_path import cpu_name
from make_model import write_streamed

TRACE_FILE = "profile_trace.json.gz"
MAX_TRACE_BYTES = 15 << 20  # a device call brings back files of at most 16 MiB


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one run: a GPU's, or `SMOKE`'s for a CPU."""

    batches: tuple[int, ...] = (1, 8, 64, 256)
    context: int = 1024  # prompt tokens of each decoding sequence
    decode_steps: int = 32
    warm_steps: int = 2  # decode steps run before the timed ones
    prefill_len: int = 2048
    prefill_prompts: int = 4  # timed, after one untimed
    profile_batch: int = 64
    profile_steps: int = 3
    host_profile_steps: int = 8  # under cProfile, after the largest batch's timed steps
    # attention_sweep (`device_kernels`): its decode batches, timed calls a setting,
    # and how many settings (0: all)
    sweep_batches: tuple[int, ...] = (64, 256)
    sweep_iters: int = 20
    sweep_configs: int = 0
    max_num_batched_tokens: int = 2048
    copy_bytes: int = 4 << 30
    matmul: int = 8192
    demo_steps: int = 64
    torch_batches: tuple[int, ...] = (1, 64)
    torch_tokens: int = 40  # new tokens a generate call makes; the gaps after its 2nd timed


SMOKE = Plan(
    batches=(1, 2),
    context=64,
    decode_steps=4,
    prefill_len=128,
    prefill_prompts=2,
    profile_batch=2,
    profile_steps=2,
    host_profile_steps=2,
    sweep_batches=(2,),
    sweep_iters=1,
    sweep_configs=2,
    max_num_batched_tokens=128,
    copy_bytes=64 << 20,
    matmul=256,
    demo_steps=8,
    torch_batches=(1, 2),
    torch_tokens=8,
)


class Skip(Exception):
    """A section that cannot run here (no torch): recorded, not an error."""


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


class Section:
    """One section's JSON file, rewritten whole (atomically) after each piece."""

    def __init__(self, args, name: str, device: str | None):
        self.path = os.path.join(args.out, f"{name}.json")
        self.data = {
            "section": name,
            "status": "running",
            "shape": args.shape,
            "smoke": args.smoke,
            "machine": {"device": device, "cpu": cpu_name(), "cpu_count": os.cpu_count()},
            "command": args.command,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        self.write()

    def update(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def error(e: Exception) -> dict:
    """The fields that record exception `e` (being handled) in a section or a row."""
    return {
        "status": f"error: {type(e).__name__}: {e}",
        "traceback": traceback.format_exc()[-3000:],
    }


def run_section(section: Section, fn, *args) -> None:
    """`fn(section, *args)`, whose return value, if any, is the status ("ok" if not);
    its exception (or Skip) is recorded, not raised."""
    t0 = time.perf_counter()
    try:
        result = {"status": fn(section, *args) or "ok"}
    except Skip as e:
        result = {"status": f"skipped: {e}"}
    except Exception as e:
        result = error(e)
    section.update(**result, section_s=round(time.perf_counter() - t0, 1))
    log(f"{section.data['section']}: {result['status']}")


def rows_status(rows: list[dict]) -> str:
    """A section's status from its rows' (one per batch)."""
    failed = [r["batch"] for r in rows if r["status"].startswith("error")]
    skipped = [r["batch"] for r in rows if r["status"].startswith("skipped")]
    if failed:
        return f"error: batches {failed} failed" + (f", {skipped} skipped" if skipped else "")
    return f"partial: batches {skipped} skipped, out of time" if skipped else "ok"


def probed(out: str) -> tuple[float | None, float | None]:
    """The probe's bandwidth (bytes/s) and bf16 peak (FLOP/s), None where it has none."""
    try:
        with open(os.path.join(out, "probe.json")) as f:
            probe = json.load(f)
    except (OSError, ValueError):
        return None, None
    bandwidth, peak = probe.get("bandwidth_GB_s"), probe.get("matmul_TFLOP_s")
    return bandwidth and bandwidth * 1e9, peak and peak * 1e12


def timed(fn, reps: int) -> float:
    """The best of `reps` timed calls of `fn` (after one untimed), in seconds."""
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# --------------------------------------------------------------------------- probe


def jax_device() -> str:
    import jax

    return jax.devices()[0].device_kind


def bandwidths(num_bytes: int) -> tuple[float, float, int]:
    """Device memory bandwidth in bytes/s over a `num_bytes` bfloat16 array: `x + 1`
    (read and written: 2 x the bytes) and `sum(x)` (read); and the array's bytes."""
    import jax
    import jax.numpy as jnp

    # [rows, 8192]: no dimension near 2^31 elements. `x + 1`, not `x + 0` (folded away).
    x = jnp.zeros((num_bytes // 2 // 8192, 8192), jnp.bfloat16)
    add = jax.jit(lambda a: a + 1)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    copy_s = timed(lambda: add(x).block_until_ready(), 8)
    read_s = timed(lambda: total(x).block_until_ready(), 8)
    return 2 * x.nbytes / copy_s, x.nbytes / read_s, x.nbytes


def probe(section: Section, plan: Plan) -> None:
    import jax
    import jax.numpy as jnp
    import jaxlib

    dev = jax.devices()[0]
    section.update(
        platform=dev.platform,
        num_devices=jax.device_count(),
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        platform_version=getattr(dev.client, "platform_version", None),
        memory_stats_bytes=dev.memory_stats() or None,
    )
    copy, read, nbytes = bandwidths(plan.copy_bytes)
    section.update(
        array_bytes=nbytes,
        copy_GB_s=round(copy / 1e9, 1),
        read_GB_s=round(read / 1e9, 1),
        # MBU's denominator: the higher reading (a low one would overstate MBU)
        bandwidth_GB_s=round(max(copy, read) / 1e9, 1),
    )
    n = plan.matmul
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    dot = jax.jit(jnp.dot)
    reps = 10

    def matmuls():
        for _ in range(reps):
            c = dot(a, b)
        c.block_until_ready()

    matmul_s = timed(matmuls, 3) / reps
    section.update(
        matmul_n=n,
        matmul_ms=round(matmul_s * 1e3, 4),
        matmul_TFLOP_s=round(2 * n**3 / matmul_s / 1e12, 2),
        memory_stats_after_bytes=dev.memory_stats() or None,
    )


# ---------------------------------------------------------------- the 8B sections


def model_dir(args) -> tuple[str, dict]:
    """`args.shape`'s model directory in the work dir (written unless a finished one
    is there), and how long that took."""
    path = os.path.join(args.work_dir, f"{args.shape}-bfloat16")
    done = os.path.join(path, "written")
    if os.path.exists(done):
        return path, {"weights": "reused", "path": path}
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    num_bytes = write_streamed(args.shape, path)
    seconds = time.perf_counter() - t0
    open(done, "w").close()
    return path, {
        "weights": "make_model.write_streamed: random bfloat16 safetensors",
        "path": path,
        "weight_file_bytes": num_bytes,
        "write_s": round(seconds, 1),
        "write_GB_s": round(num_bytes / seconds / 1e9, 3),
    }


def decode_tokens(plan: Plan, batch: int) -> int:
    """max_tokens of a decode batch's requests: the first ones decode while the others
    prefill (~batch x context / budget steps, more as the decodes take budget), then
    the steps until all decode, warm-up, the timed steps and the traced ones."""
    prefill_steps = -(-batch * plan.context // plan.max_num_batched_tokens)
    more = plan.profile_steps + plan.host_profile_steps
    return 2 * prefill_steps + plan.warm_steps + plan.decode_steps + more + 16


def build_llm(plan: Plan, path: str, batches: list[int], **engine_args):
    from jaxserve import LLM

    page = engine_args.pop("block_size", 16)  # (--engine_args may set the page size)
    longest = max(plan.context + decode_tokens(plan, b) for b in batches)
    max_len = -(-max(longest, plan.prefill_len + 1) // page) * page
    pages = max(b * -(-(plan.context + decode_tokens(plan, b)) // page) for b in batches)
    return LLM(
        path,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_num_seqs=max(batches),
        max_model_len=max_len,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        block_size=page,
        num_kv_pages=pages + plan.prefill_len // page + 16,
        warmup=False,  # compile only the shapes used, as they first occur
        stats_interval_s=0,
        **engine_args,
    )


def start_decoding(engine, plan: Plan, batch: int, vocab: int) -> None:
    """Adds `batch` distinct prompts and steps until every sequence decodes, then
    `plan.warm_steps` more (the first of them compiles the batch's decode program)."""
    import numpy as np

    from jaxserve import SamplingParams
    from jaxserve.generate_request import GenerateRequest

    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens(plan, batch), ignore_eos=True)
    for i in range(batch):
        prompt = rng.integers(3, vocab, plan.context).tolist()
        engine.add_request(GenerateRequest(f"b{batch}-{i}", prompt, params))
    while engine.scheduler.waiting or len(engine.scheduler.running) < batch:
        engine.step()
    prompt_tokens = -1
    while engine.stats().prompt_tokens != prompt_tokens:  # a step with no prompt token
        prompt_tokens = engine.stats().prompt_tokens
        engine.step()
    for _ in range(plan.warm_steps):
        engine.step()


def timed_steps(engine, steps: int, trace=None) -> dict:
    """`steps` engine steps: wall time, the engine's host and device seconds, tokens,
    and the KV tokens the steps read (each running sequence's, averaged)."""
    kv_before = sum(s.num_computed for s in engine.scheduler.running)
    before = engine.stats()
    t0 = time.perf_counter()
    for i in range(steps):
        if trace is None:
            engine.step()
        else:
            with trace("decode_step", step_num=i):
                engine.step()
    wall = time.perf_counter() - t0
    after = engine.stats()
    kv_after = sum(s.num_computed for s in engine.scheduler.running)
    return {
        "running": len(engine.scheduler.running),
        "wall": wall,
        "host": after.host_seconds - before.host_seconds,
        "device": after.device_seconds - before.device_seconds,
        "tokens": after.generation_tokens - before.generation_tokens,
        "prompt_tokens": after.prompt_tokens - before.prompt_tokens,
        "kv_tokens": (kv_before + kv_after) / 2 + len(engine.scheduler.running) / 2,
    }


def weight_bytes_read(llm) -> int:
    """The weights a decode step reads: all but an untied embedding table, of which it
    gathers only the batch's rows."""
    m, weights = llm.config.model, llm.engine.model_info().weight_bytes
    if m.tie_word_embeddings:
        return weights
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[llm.config.dtype]
    return weights - m.vocab_size * m.hidden_size * itemsize


def decode_row(llm, plan: Plan, batch: int, bandwidth: float | None) -> dict:
    engine = llm.engine
    t0 = time.perf_counter()
    start_decoding(engine, plan, batch, llm.config.model.vocab_size)
    setup = time.perf_counter() - t0
    r = timed_steps(engine, plan.decode_steps)
    steps = plan.decode_steps
    kv_token = llm.config.kv_bytes_per_page() / llm.config.cache.page_size
    moved = weight_bytes_read(llm) + r["kv_tokens"] * kv_token
    step = r["wall"] / steps
    return {
        "batch": batch,
        "context_tokens": plan.context,
        "steps": steps,
        "running": r["running"],  # = batch: none finished early
        "setup_s": round(setup, 1),  # prefill and the compilations it met
        "ms_per_step": round(step * 1e3, 3),
        "host_ms_per_step": round(r["host"] / steps * 1e3, 3),
        "device_ms_per_step": round(r["device"] / steps * 1e3, 3),
        "host_share": round(r["host"] / (r["host"] + r["device"]), 4),
        "output_tok_s": round(r["tokens"] / r["wall"], 1),
        "prompt_tokens_in_timed_steps": r["prompt_tokens"],  # 0: decode only
        "kv_tokens_read_per_step": round(r["kv_tokens"]),
        "bytes_read_per_step_GB": round(moved / 1e9, 3),
        "MBU": round(moved / step / bandwidth, 4) if bandwidth else None,
        **({"host_profile": host_profile(engine, plan)} if batch == max(plan.batches) else {}),
    }


def host_profile(engine, plan: Plan, top: int = 25) -> list:
    """`plan.host_profile_steps` more steps under cProfile: the functions of the most
    own time, as [function, calls a step, own ms a step, cumulative ms a step]."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    steps = plan.host_profile_steps
    profiler.runcall(lambda: [engine.step() for _ in range(steps)])
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        [
            f"{os.path.basename(f)}:{line}:{name}",
            round(nc / steps, 1),
            round(tt / steps * 1e3, 3),
            round(ct / steps * 1e3, 3),
        ]
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]


def profile_steps(section: Section, engine, plan: Plan, args) -> None:
    """Traces `plan.profile_steps` decode steps of the running batch into the work
    dir, keeps the Perfetto trace in OUT, and writes its summary."""
    import jax
    from trace_summary import summarize

    trace_dir = os.path.join(args.work_dir, "trace")
    shutil.rmtree(trace_dir, ignore_errors=True)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # every Python call: a huge trace, a slower host
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
        r = timed_steps(engine, plan.profile_steps, jax.profiler.StepTraceAnnotation)
    steps = plan.profile_steps
    section.update(
        batch=len(engine.scheduler.running),
        engine_ms_per_step=round(r["wall"] / steps * 1e3, 3),
        engine_host_ms_per_step=round(r["host"] / steps * 1e3, 3),
    )
    found = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        files = glob.glob(f"{trace_dir}/**/*", recursive=True)
        raise FileNotFoundError(f"no perfetto_trace.json.gz among {files}")
    size = os.path.getsize(found[0])
    if size <= MAX_TRACE_BYTES:
        shutil.copy(found[0], os.path.join(args.out, TRACE_FILE))
    section.update(
        trace_bytes=size,
        trace_file=TRACE_FILE if size <= MAX_TRACE_BYTES else f"too big, left at {found[0]}",
    )
    section.update(**summarize(found[0], "decode_step"))


def prefill(section: Section, llm, plan: Plan, peak: float | None) -> None:
    import numpy as np

    from jaxserve import SamplingParams
    from jaxserve.generate_request import GenerateRequest

    engine, m, n = llm.engine, llm.config.model, plan.prefill_len
    rng = np.random.default_rng(n)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(plan.prefill_prompts + 1):  # the first untimed: it may compile
        prompt = rng.integers(3, m.vocab_size, n).tolist()
        engine.add_request(GenerateRequest(f"prefill-{i}", prompt, params))
        steps = engine.stats().steps
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    steps = engine.stats().steps - steps  # the last prompt's
    step = float(np.median(times[1:]))
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    layer = m.hidden_size * (2 * q + 2 * kv + 3 * m.intermediate_size)  # q, o, k, v; MLP
    matmul_params = m.num_layers * layer
    linear = 2 * matmul_params * n
    attention = m.num_layers * 2 * 2 * q * n * (n + 1) // 2  # QK^T and PV, causal
    lm_head = 2 * m.hidden_size * m.vocab_size  # the last token's row only
    flops = linear + attention + lm_head
    section.update(
        prompt_tokens=n,
        prompts_timed=plan.prefill_prompts,
        steps_per_prompt=steps,
        ms_per_prompt=round(step * 1e3, 3),
        prompt_tok_s=round(n / step, 1),
        flops_per_prompt={"linear": linear, "attention": attention, "lm_head": lm_head},
        TFLOP_s=sig(flops / step / 1e12),
        MFU=sig(flops / step / peak) if peak else None,
    )


def decode_batches(plan: Plan, sections: dict) -> list[int]:
    batches = list(plan.batches) if "llama8b_decode" in sections else []
    if "profile" in sections and plan.profile_batch not in batches:
        batches.append(plan.profile_batch)
    return batches


def decode(section: Section | None, llm, plan: Plan, args, deadline: float, sections) -> str:
    """A decode row per batch (and the profile during its batch), each batch alone:
    one failing (out of memory, say) or out of time ends no other."""
    bandwidth, _ = probed(args.out)
    rows = []
    for batch in decode_batches(plan, sections):
        if deadline - time.time() < 15:
            rows.append({"batch": batch, "status": "skipped: out of time"})
        else:
            log(f"decode batch {batch}")
            try:
                rows.append({**decode_row(llm, plan, batch, bandwidth), "status": "ok"})
                if batch == plan.profile_batch and "profile" in sections:
                    run_section(sections["profile"], profile_steps, llm.engine, plan, args)
            except Exception as e:
                rows.append({"batch": batch, **error(e)})
            log(f"decode batch {batch}: {rows[-1]}")
            llm.engine.abort_all()
            while llm.engine.has_unfinished():
                llm.engine.step()
        if section is not None:
            section.update(rows=rows)
    return rows_status(rows)


def llama8b(args, plan: Plan, deadline: float) -> None:
    wanted = [s for s in ("llama8b_decode", "llama8b_prefill", "profile") if s in args.sections]
    sections = {name: Section(args, name, jax_device()) for name in wanted}
    bandwidth, peak = probed(args.out)
    batches = decode_batches(plan, sections)
    try:
        path, weights = model_dir(args)
        log(f"weights: {weights}")
        t0 = time.perf_counter()
        llm = build_llm(plan, path, batches or [1], **args.engine_args)
        loaded = {**weights, "engine_start_s": round(time.perf_counter() - t0, 1)}
        loaded["engine_args"] = args.engine_args
        log(f"engine ready in {loaded['engine_start_s']} s")
    except Exception as e:
        for section in sections.values():
            section.update(**error(e))
        raise
    for section in sections.values():
        section.update(
            model=loaded,
            weight_bytes=llm.engine.model_info().weight_bytes,
            bandwidth_GB_s=bandwidth and bandwidth / 1e9,
            peak_TFLOP_s=peak and peak / 1e12,
        )
    if "llama8b_prefill" in sections:
        run_section(sections["llama8b_prefill"], prefill, llm, plan, peak)
    if "llama8b_decode" in sections:
        run_section(sections["llama8b_decode"], decode, llm, plan, args, deadline, sections)
    elif batches:  # the profile's batch alone
        decode(None, llm, plan, args, deadline, sections)
    llm.close()
    for section in sections.values():  # the profile, when its batch did not run
        if section.data["status"] == "running":
            section.update(status=f"skipped: no decode batch {plan.profile_batch} ran")


# ---------------------------------------------------------------------------- demo


def demo(section: Section, plan: Plan, bandwidth: float | None) -> None:
    from jaxserve import LLM

    with LLM(warmup=False, skip_tokenizer_init=True) as llm:  # the demo model, its defaults
        small = dataclasses.replace(plan, context=32, decode_steps=plan.demo_steps)
        row = decode_row(llm, small, 1, bandwidth)
    section.update(model="demo-model (LLM() default)", dtype=llm.config.dtype, **row)
