"""bfloat16 on the CPU: the runner stores the linears [out, in] (`models.layers.store_rows`)
so decode steps' matmuls run in the few-row kernel; generation is unchanged."""

from jaxserve import LLM, SamplingParams
from jaxserve.runner import weight_update
from models import layers
from pallas_kernels.cpu import library as cpu_library

KW = dict(
    dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=64, warmup=False
)
PROMPTS = ["Once upon a time", "def f(x):", "The capital of France", "1, 2, 3,"]


def linears(llm):
    model = llm.engine.runner.model_def.merge(llm.engine.runner.weights)
    return [m for _, m in model.iter_modules() if isinstance(m, layers.RowsLinear)]


def test_bfloat16_linears_are_stored_in_rows_and_generate_the_same(monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rows = LLM(**KW)
    assert linears(rows)  # every projection
    got = [o.outputs[0] for o in rows.generate(PROMPTS, params, use_tqdm=False)]
    monkeypatch.setattr(weight_update, "store_rows", lambda model: model)
    plain = LLM(**KW)
    assert not linears(plain)
    want = [o.outputs[0] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    # bfloat16 products summed in another order: the same tokens, near log-probabilities
    agree = sum(g.token_ids == w.token_ids for g, w in zip(got, want, strict=True))
    assert agree >= 3, [(g.token_ids, w.token_ids) for g, w in zip(got, want, strict=True)]


def test_float32_keeps_its_layout():
    assert not linears(LLM(**{**KW, "dtype": "float32"}))


def forward_hlo(llm) -> str:
    llm.engine.warm_up()
    programs = llm.engine.compiled
    return "".join(p.as_text() for name, p in programs.items() if name.startswith("forward"))


def test_two_engines_in_a_process_each_keep_their_own_kernel_choice():
    """native_cpu_kernels is each engine's: one built without the kernels after one
    with them leaves the first's layout, programs and bundle manifest as they were
    (the switch was process-wide: the second turned the kernels off for both)."""
    on = LLM(**KW)
    off = LLM(**KW, native_cpu_kernels=False)
    assert cpu_library.is_loaded()
    assert linears(on) and not linears(off)
    # Compiled after `off` was built, `on`'s programs still call the kernels.
    on_text, off_text = forward_hlo(on), forward_hlo(off)
    kernel = 'custom_call_target="jaxserve_'
    assert kernel + "matmul_bf16" in on_text and kernel + "attention_bf16" in on_text
    assert kernel not in off_text  # XLA's matmuls, the reference attention
    assert on.engine.runner.manifest(kv_transfer=False)["target"]["cpu_kernels"] is True
    assert off.engine.runner.manifest(kv_transfer=False)["target"]["cpu_kernels"] is False
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for llm in (on, off):
        assert len(llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
