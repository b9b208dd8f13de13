"""Run in a subprocess with 8 fake CPU devices: multi-LoRA under tensor parallelism gives
what one device gives (the adapters' A and B sharded as their base layers).

Usage: python lora_tp_check.py MODEL_DIR TP ADAPTER_DIR BASES
(BASES: "none", "int8", "int4", "fp8", comma-separated; the adapters are written
under ADAPTER_DIR)

Three adapters (ranks 2, 4 and 8; attention only, MLP only, every projection) and
the base model serve the same prompts (shared prefixes) with greedy decoding, on one
device and on TP devices, with two slots (the adapters swap), chunked prefill and
preemption, in float32 and with int8, int4 and fp8 base weights: the tokens must be
equal and the logprobs close. Every step is waited for (the engine fetches each step's
tokens), which keeps the CPU collectives from deadlocking.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from engine_utils import SMALL_LLM_IDS
from lora_files import write_adapter

from jaxserve import LLM, LoRARequest, SamplingParams

KW = dict(
    SMALL_LLM_IDS,
    enable_lora=True,
    max_loras=2,
    max_lora_rank=8,
    max_num_batched_tokens=16,
    num_kv_pages=14,
    max_num_seqs=4,
)
TARGETS = [("self_attn",), ("mlp",), ("self_attn", "mlp")]


def serve(model_dir: str, tp: int, quantization: str | None, adapter_dir: str):
    llm = LLM(model_dir, tensor_parallel_size=tp, quantization=quantization, **KW)
    modules = llm.engine.adapters.layout.modules
    loras = [None]
    for i, (rank, parts) in enumerate(zip((2, 4, 8), TARGETS, strict=True)):
        mine = {k: v for k, v in modules.items() if k.split(".")[2] in parts}
        path = os.path.join(adapter_dir, f"adapter{i}")
        if not os.path.exists(path):
            write_adapter(path, mine, rank=rank, seed=i)
        loras.append(LoRARequest(f"adapter{i}", i + 1, path))
    rs = np.random.RandomState(0)
    system = rs.randint(3, 100, size=17).tolist()
    prompts = [
        {"prompt_token_ids": system + rs.randint(3, 100, size=2 + j).tolist()} for j in range(8)
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, lora_request=[loras[j % 4] for j in range(8)])
    assert llm.engine.adapters.slots.num_evictions > 0
    if tp > 1:
        check_shardings(llm.engine.runner)
    llm.close()
    return [
        (
            o.outputs[0].token_ids,
            [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)],
        )
        for o in outs
    ]


def check_shardings(runner):
    """A and B split as their base layer: a column-parallel layer's B on its outputs, a
    row-parallel layer's A on its inputs; the other matrix whole on every device."""
    for e in runner.lora.entries:
        a, b = (runner.weights[i].sharding.spec for i in (e.a, e.b))
        a, b = tuple(a) + (None,) * (3 - len(a)), tuple(b) + (None,) * (3 - len(b))
        if e.name.endswith(("o_proj", "down_proj")):  # row-parallel
            assert a == (None, None, "model") and b == (None, None, None), (e.name, a, b)
        else:
            assert a == (None, None, None) and b == (None, None, "model"), (e.name, a, b)


def main():
    model_dir, tp, adapter_dir, bases = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    for base in bases.split(","):
        quantization = None if base == "none" else base
        want = serve(model_dir, 1, quantization, adapter_dir)
        got = serve(model_dir, tp, quantization, adapter_dir)
        for (t1, lp1), (t2, lp2) in zip(want, got, strict=True):
            assert t1 == t2, (t1, t2)
            np.testing.assert_allclose(lp1, lp2, atol=1e-3)
        name = f"lora {quantization}" if quantization else "lora"
        print(f"{name} tp={tp}: ok", flush=True)


if __name__ == "__main__":
    main()
