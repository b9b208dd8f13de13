"""Multi-LoRA parity with PEFT on transformers: the same random base weights, adapters
made and saved with PEFT, served by the engine several at once (and requests
without one) in the same batches: greedy tokens are PEFT's (up to a float32 tie) and
their logprobs are PEFT's within float32 tolerance."""

import numpy as np
import pytest
from engine_utils import engine_config
from lora_utils import ADAPTERS, base_model, check_greedy, hf_logprobs, make_adapter

from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.lora import LoRALayout, LoRARequest, load_adapter
from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams

LORA = dict(enable_lora=True, max_loras=3, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(hf_model_dir, tmp_path_factory):
    """case -> (base dir, {adapter name: (LoRARequest, PEFT model)}, HF base model)."""
    cache = {}

    def get(case: str):
        if case not in cache:
            path, _ = hf_model_dir(case)
            root = tmp_path_factory.mktemp(f"{case}_adapters")
            made = {}
            for i, (name, lora) in enumerate(ADAPTERS.items()):
                out = str(root / name)
                model = make_adapter(path, out, seed=10 + i, **lora)
                made[name] = (LoRARequest(name, i + 1, out), model)
            cache[case] = (path, made, base_model(path))
        return cache[case]

    return get


def _requests(vocab: int, loras: list[LoRARequest | None], max_tokens: int):
    """Two prompts per adapter (and two without one), sharing a 17-token system
    prompt (two full pages of 8) across adapters: prefix hits within an adapter,
    never across."""
    rs = np.random.RandomState(0)
    system = rs.randint(3, vocab, size=17).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    out = []
    for j, lora in enumerate(loras):
        for k in range(2):
            prompt = system + rs.randint(3, vocab, size=3 + 4 * k + j).tolist()
            out.append(GenerateRequest(f"{j}-{k}", tuple(prompt), params, lora=lora))
    return out


def _serve(engine: LLMEngine, requests: list[GenerateRequest]) -> tuple[dict, int]:
    """Every request's (tokens, logprobs), and the most distinct LoRA slots one step had."""
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append({item.seq.lora_slot for item in plan.scheduled})
        return plan

    engine.scheduler.schedule = recording
    for r in requests:
        engine.add_request(r)
    results = {}

    def keep(out):
        if out.finished:
            c = out.outputs[0]
            chosen = [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
            results[out.request_id] = (c.token_ids, chosen)

    engine.run(keep)
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity
    engine.adapters.slots.check_invariant({})  # nothing runs: no slot is pinned
    return results, max(len(p) for p in plans)


SCENARIOS = {
    # Every request in one step: four slots (0, and the three adapters) in every batch.
    "one_batch": dict(max_num_seqs=16, max_num_batched_tokens=256),
    # 16-token steps chunk every prompt; 14 pages of 8 cannot hold the batch: preemption;
    # two slots for three adapters: adapters swap in and out of the slots.
    "stress": dict(max_num_seqs=4, max_num_batched_tokens=16, num_pages=14, max_loras=2),
    # The same with asynchronous scheduling (slot writes between steps in flight).
    "async": dict(
        max_num_seqs=4,
        max_num_batched_tokens=16,
        num_pages=14,
        max_loras=2,
        async_scheduling=True,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama2_mha", "qwen2_14_to_2"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_mixed_adapters_match_peft(case, scenario, adapters):
    path, made, base = adapters(case)
    kw = {**LORA, **SCENARIOS[scenario]}
    engine = LLMEngine(engine_config(path, page_size=8, **kw))
    loras = [None] + [lora for lora, _ in made.values()]
    requests = _requests(base.config.vocab_size, loras, max_tokens=10)
    results, most_slots = _serve(engine, requests)
    models = {None: base} | {lora.lora_int_id: model for lora, model in made.values()}
    for r in requests:
        tokens, logprobs = results[r.request_id]
        assert len(tokens) == 10
        model = models[r.lora.lora_int_id if r.lora else None]
        check_greedy(model, list(r.prompt_token_ids), tokens, logprobs)
    slots = engine.adapters.slots
    if scenario == "one_batch":
        assert most_slots == 4  # base + three adapters in one step
        assert slots.num_evictions == 0
    else:  # (one batch has no prefix hit: nothing is cached when all are admitted)
        assert engine.scheduler.num_preemptions > 0
        assert slots.num_evictions > 0  # three adapters through two slots
        assert engine.scheduler.prefix_hits > 0
    engine.close()


# Every architecture: prompt logits of one step mixing the base model and adapters on
# every projection it has (for the MoE families: attention, the dense layers' MLPs
# and Qwen2-MoE's shared expert; never the experts).
ARCHITECTURES = [
    "llama3_gqa_rope_scaling",
    "qwen2_14_to_2",
    "qwen3_head_dim_mismatch",
    "gemma2_window_softcap",
    "gemma3_local_global_rope",
    "mixtral_top2_of_8",
    "qwen3_moe_top3_of_16",
    "qwen2_moe_shared_expert",
]


@pytest.mark.slow
@pytest.mark.parametrize("case", ARCHITECTURES)
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_every_architecture_mixes_adapters_in_one_step(case, quantization, adapters):
    path, made, base = adapters(case)
    runner = ModelRunner(engine_config(path, quantization=quantization, **LORA))
    layout = runner.lora.layout()
    vocab = base.config.get_text_config().vocab_size
    rs = np.random.RandomState(3)
    work, expected, free = [], [], list(range(1, runner.num_pages))
    for slot, (_, (lora, model)) in enumerate([(None, (None, base)), *made.items()]):
        if lora is not None:
            runner.load_lora(slot, load_adapter(lora, layout, path))
        ids = rs.randint(3, vocab, size=9 + 5 * slot).tolist()
        work.append(SeqWork(ids, 0, [free.pop() for _ in range(-(-len(ids) // 8))], lora_slot=slot))
        expected.append(hf_logprobs(model, ids))
    logits = np.asarray(runner.execute(runner.build(work, all_logits=True)))
    row = 0
    for w, theirs in zip(work, expected, strict=True):
        ours = logits[row : row + len(w.token_ids)]
        row += len(w.token_ids)
        ours = ours - ours.max(-1, keepdims=True)
        ours -= np.log(np.exp(ours).sum(-1, keepdims=True))  # log_softmax, as `theirs`
        if quantization is None:
            np.testing.assert_allclose(ours, theirs, atol=3e-4, err_msg=f"slot {w.lora_slot}")
        else:  # int8 base weights under float adapters: as close as int8 weights get
            err = np.abs(ours - theirs).max() / np.abs(theirs).max()
            assert err < 0.1, (w.lora_slot, err)


def test_adapters_are_read_as_peft_saves_them(adapters):
    path, made, _ = adapters("llama2_mha")
    lora, model = made["mlp_r2_patterns"]
    state = {n: p.detach().numpy() for n, p in model.named_parameters() if "lora_" in n}
    dims = {"gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
    modules = {f"layers.{i}.mlp.{p}": d for i in range(2) for p, d in dims.items()}
    adapter = load_adapter(lora, LoRALayout(modules, max_rank=8), path)
    assert set(adapter.weights) == set(modules)
    assert adapter.rank == 6  # down_proj's rank_pattern
    a, b = adapter.weights["layers.1.mlp.up_proj"]
    peft = "base_model.model.model.layers.1.mlp.up_proj.lora_{}.default.weight"
    np.testing.assert_allclose(a, state[peft.format("A")])
    # The scale folded into B: up_proj's alpha_pattern (10) over r (2).
    np.testing.assert_allclose(b, state[peft.format("B")].T * (10 / 2), rtol=1e-6)
    assert adapter.weights["layers.0.mlp.down_proj"][0].shape == (6, 96)
