"""What XLA makes of the step: the KV cache is updated in place, never copied."""

import pytest

from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step import StepInput, forward
from tests.engine_utils import engine_config


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(engine_config(EMBEDDED_MODELS["demo-model-tiny"], page_size=16))


@pytest.mark.parametrize("q_lens", [[1], [1, 1], [5], [1, 7, 1]])
def test_the_step_never_copies_a_kv_cache(runner, q_lens):
    # A lone decode (one token) once made XLA copy the layers' caches every step
    # (a 57 ms decode took 1 s on the benchmark model): a copy needs scratch
    # memory the size of a cache, where the step itself needs far less.
    work = [SeqWork([3] * n, 20 - n, [1 + 2 * i, 2 + 2 * i]) for i, n in enumerate(q_lens)]
    batch = runner.build(work)
    compiled = forward.lower(
        runner.graphdef, runner.state, runner.kv_caches, StepInput.from_host(batch)
    ).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < runner.kv_caches[0].nbytes
