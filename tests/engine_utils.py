"""Helpers to build engines and runners over test checkpoints."""

from __future__ import annotations

import os

import numpy as np

from jaxserve import config
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine
from jaxserve.generate_request import GenerateRequest
from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams

# `LLM(...)` arguments of a small test engine, compiling as shapes occur.
SMALL_LLM = dict(
    max_model_len=128,
    block_size=8,
    num_kv_pages=64,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    warmup=False,
)
# The same for check scripts run on token ids in a subprocess (no tokenizer; the
# persistent compilation cache off, as in-process tests run).
SMALL_LLM_IDS = dict(SMALL_LLM, skip_tokenizer_init=True, compilation_cache_dir=None)


def engine_config(path: str, *, page_size=8, num_pages=64, max_model_len=128, **kw):
    """An EngineConfig for a test checkpoint; `kw` are flat engine arguments."""
    return config.engine_config(
        path,
        ModelConfig.from_pretrained(path),
        block_size=page_size,
        num_kv_pages=num_pages,
        max_model_len=max_model_len,
        **{"max_num_seqs": 8, "warmup": False, **kw},
    )


def prompt_logits(runner: ModelRunner, ids: list[int], pages: list[int]) -> np.ndarray:
    """Logits [len(ids), V] of one sequence computed in one step on `pages`."""
    batch = runner.build([SeqWork(ids, 0, pages)], all_logits=True)
    return np.asarray(runner.execute(batch))[: len(ids)]


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of all prompts, submitted together."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), p, params))
    results = {}
    engine.run(lambda out: results.__setitem__(out.request_id, out.outputs[0].token_ids))
    engine.pool.check_invariant()
    assert engine.pool.num_free == engine.pool.capacity
    return [results[str(i)] for i in range(len(prompts))]


HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo_heldout.json")


def demo_validation_ids(num_tokens: int | None = None) -> list[int]:
    """The first `num_tokens` (default all) token ids of the demo models' held-out
    validation text, shipped in `tests/data` (the documents `tools/train_demo_model.py`
    sets aside and never trains on), tokenized as it does: each document followed by
    the end-of-text token."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    from jaxserve.assets import EMBEDDED_MODELS

    with open(HELDOUT) as f:
        docs = json.load(f)["documents"]
    tok = HFTokenizer.from_file(os.path.join(EMBEDDED_MODELS["demo-model"], "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += [*enc.ids, eot]
    return ids[:num_tokens]
