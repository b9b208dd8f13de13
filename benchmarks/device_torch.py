"""`device_bench.py`'s torch_fallback section: the same Llama shape in Hugging Face
transformers on PyTorch, decode tok/s from `generate` with a static cache (which
transformers compiles with torch.compile, mode reduce-overhead, on a GPU), timed by
the gaps between the tokens it streams. Its own process: torch and JAX would both
take the GPU's memory.
"""

from __future__ import annotations

import itertools
import time

from device_sections import Plan, Section, Skip, error, log, rows_status
from make_model import LLAMA_SHAPES, transformers_config


def torch_row(model, ids, plan: Plan, compiled: bool) -> dict:
    """One `generate` call over `ids` [batch, context]: the median gap between streamed
    tokens after the first two (prefill, and the first decode step, which compiles)."""
    import torch
    import transformers

    class Clock(transformers.generation.streamers.BaseStreamer):
        """The time of each `put` (generate copies the new tokens to the host first)."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=plan.torch_tokens,
            min_new_tokens=plan.torch_tokens,
            do_sample=False,
            # transformers compiles the decode step of a static cache itself (torch.compile,
            # mode reduce-overhead), on accelerators only
            cache_implementation="static",
            disable_compile=not compiled,
            streamer=clock,
            pad_token_id=0,
        )
    gaps = sorted(b - a for a, b in itertools.pairwise(clock.times[2:]))
    step = gaps[len(gaps) // 2]
    batch, context = ids.shape
    return {
        "batch": batch,
        "context_tokens": context,
        "generate_s": round(time.perf_counter() - t0, 1),  # compilation included
        "ms_per_step": round(step * 1e3, 3),
        "output_tok_s": round(batch / step, 1),
        "torch_compiled": compiled and hasattr(model, "_compiled_call"),
        "status": "ok",
    }


def torch_decode(section: Section, args, plan: Plan, deadline: float) -> str:
    try:
        import torch
        import transformers
    except ImportError as e:
        raise Skip(f"torch or transformers does not import: {e}") from None
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    section.update(
        machine={
            **section.data["machine"],
            "device": torch.cuda.get_device_name() if cuda else "cpu",
        },
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
    )
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with device:
        model = transformers.AutoModelForCausalLM.from_config(
            transformers_config(args.shape), dtype=torch.bfloat16
        ).eval()
    section.update(init_s=round(time.perf_counter() - t0, 1))
    vocab = LLAMA_SHAPES[args.shape].vocab
    rows = []
    for batch in plan.torch_batches:
        if time.time() > deadline - 15:
            rows.append({"batch": batch, "status": "skipped: out of time"})
            continue
        log(f"torch decode batch {batch}")
        ids = torch.randint(3, vocab, (batch, plan.context), device=device)
        try:
            rows.append(torch_row(model, ids, plan, compiled=True))
        except Exception as e:  # torch.compile's failure: record it, then run eagerly
            failed = error(e)
            log(f"torch decode batch {batch}, compiled: {failed['status']}")
            rows.append({**torch_row(model, ids, plan, compiled=False), "compiled_error": failed})
        log(f"torch decode batch {batch}: {rows[-1]}")
        section.update(rows=rows)
    return rows_status(rows)
