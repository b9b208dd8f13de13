"""What XLA makes of the step (the KV cache is updated in place, never copied) and
what a call costs the host (the model graph is not hashed; programs are shared)."""

import pytest
from flax import nnx

from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step import StepInput, forward
from tests.engine_utils import engine_config


@pytest.fixture(scope="module")
def runner():
    # A cache (4 MiB a layer) well above the step's own scratch, so a copy of it
    # cannot hide in the margin.
    return ModelRunner(
        engine_config(EMBEDDED_MODELS["demo-model-tiny"], page_size=16, num_pages=512)
    )


@pytest.mark.parametrize("q_lens", [[1], [1, 1], [5], [1, 7, 1]])
def test_the_step_never_copies_a_kv_cache(runner, q_lens):
    # A lone decode (one token) once made XLA copy the layers' caches every step
    # (a 57 ms decode took 1 s on the benchmark model): a copy needs scratch
    # memory the size of a cache, where the step itself needs far less.
    work = [SeqWork([3] * n, 20 - n, [1 + 2 * i, 2 + 2 * i]) for i, n in enumerate(q_lens)]
    batch = runner.build(work)
    compiled = forward.lower(
        runner.model_def,
        runner.weights,
        runner.kv_caches,
        StepInput.packed(batch),
        runner.no_prev_tokens,
    ).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < runner.kv_caches[0].nbytes


def test_the_forward_program_holds_no_lm_head_over_its_token_rows(runner):
    # Prompt logprobs were a `lax.cond` branch inside the forward pass: XLA charged
    # every step (a decode too) the LM head over all T rows, in its flops, bytes and
    # temporaries. They are a program of their own now, dispatched when asked.
    batch = runner.build([SeqWork([3] * 5, 0, [1])])
    t, vocab = len(batch.input_ids), runner.config.model.vocab_size
    args = (runner.model_def, runner.weights, runner.kv_caches, StepInput.packed(batch))
    args += (runner.no_prev_tokens,)
    compiled = forward.lower(*args).compile()
    assert f"[{t},{vocab}]" not in compiled.as_text()
    flops = compiled.cost_analysis()["flops"]
    hidden = runner.config.model.hidden_size
    assert flops < 2 * t * hidden * vocab, (flops, t, hidden, vocab)


def test_a_step_does_not_hash_the_model_graph(runner, monkeypatch):
    # The compiled steps are cached under the model's static half. A GraphDef
    # hashes all its nodes on every call: twice a step it cost 1.5 ms each at
    # batch-1 decode on the benchmark model, where the whole step is ~55 ms.
    calls = []
    graphdef_hash = nnx.GraphDef.__hash__
    monkeypatch.setattr(
        nnx.GraphDef, "__hash__", lambda self: calls.append(1) or graphdef_hash(self)
    )
    batch = runner.build([SeqWork([3], 7, [1])])
    sampling = runner.build_sampling([], len(batch.kv_lens))
    runner.execute_and_sample(batch, sampling)
    runner.execute_and_sample(batch, sampling)
    assert calls == []


def test_runners_of_the_same_model_share_the_compiled_steps(runner):
    again = ModelRunner(runner.config)
    assert again.model_def == runner.model_def and again.model_def is not runner.model_def
    assert hash(again.model_def) == hash(runner.model_def)
    batch = runner.build([SeqWork([3], 7, [1])])
    runner.execute(batch)
    before = runner.compiles.count
    again.execute(batch)
    again.compiles.close()
    assert runner.compiles.count == before  # (a counter counts every compile in the process)


def test_the_warm_up_bar_counts_compile_work_by_program_size(monkeypatch):
    """The compile bar's units are the programs' sizes (their StableHLO text), which
    compile time follows: counted by programs, its estimate read 2 s at half way with
    13 s to go (small programs compiled first). It still names the program count."""
    from jaxserve.runner import warmup

    bars = []

    class Bar:
        def __init__(self, total, desc, **kw):
            self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(warmup, "tqdm", Bar)
    config = engine_config(EMBEDDED_MODELS["demo-model-tiny"], max_num_batched_tokens=32)
    runner = ModelRunner(config)
    programs = runner.warmup()
    compiling = bars[-1]
    assert compiling.desc == f"warm-up: compiling {len(programs)} programs"
    assert compiling.postfix == f"{len(programs)}/{len(programs)}"
    assert compiling.n == compiling.total > 10 * len(programs)  # characters, not programs
