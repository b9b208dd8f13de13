"""Beam search parity with transformers' `generate(num_beams=k, do_sample=False)` on
the same random weights, Llama- and Gemma-shaped: the same k sequences in the same
order, and the same scores, for beam widths 2, 4 and 8 and several length penalties
and early-stopping rules.

The engine runs with a step budget smaller than the prompts (chunked prefill), a
pool small enough to preempt beams, and every search twice (the second finds the
prompts and the beams' full pages in the prefix cache). EOS is set to a token the
model likes after the first prompt, so that beams end at EOS as well as at
max_tokens. Nothing compiles after warm-up while beams fork and copy pages.
"""

import json
import os

import numpy as np
import pytest
import torch
from hf_models import CASES, make_hf_model

from jaxserve.beam_search import beam_score
from jaxserve.llm import LLM
from jaxserve.sampling_params import BeamSearchParams, ParamError

PAGE = 8
MAX_TOKENS = 12
PROMPT_LENS = (21, 40, 9)
# (beam width, length penalty, early stopping)
SETTINGS = [
    (2, 1.0, False),
    (2, 2.0, "never"),
    (4, 1.0, False),
    (4, 0.5, True),
    (8, 1.0, False),
    (8, -1.0, "never"),
]
SMALL = dict(
    skip_tokenizer_init=True,
    block_size=PAGE,
    max_model_len=64,
    max_num_seqs=16,
    max_num_batched_tokens=16,  # < the longer prompts: chunked prefill
    compilation_cache_dir=None,
    # Gemma 3's sliding-window layers would get pages of their own, which beams do not
    # share yet (beam search is refused there: `test_beam_search_is_refused_on_a_hybrid_kv_cache`).
    disable_hybrid_kv_cache_manager=True,
)


def _with_eos(path: str, eos: int) -> None:
    """Makes `eos` the checkpoint's EOS id (config.json and generation_config.json)."""
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        with open(file) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos
        with open(file, "w") as f:
            json.dump(cfg, f)


@pytest.fixture(scope="module", params=["llama3_gqa_rope_scaling", "gemma3_local_global_rope"])
def model(request, tmp_path_factory):
    """(directory, HF model, prompts, EOS id) of a small random model."""
    arch, overrides = CASES[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_hf_model(path, arch, overrides)
    vocab = hf.config.get_text_config().vocab_size
    rs = np.random.RandomState(5)
    prompts = [rs.randint(3, vocab, size=n).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        greedy = hf.generate(
            torch.tensor([prompts[0]]), max_new_tokens=3, do_sample=False, eos_token_id=None
        )
    eos = int(greedy[0, -1])
    _with_eos(path, eos)
    return path, hf, prompts, eos


def _transformers(hf, prompt, eos, k, length_penalty, early_stopping):
    """transformers' k best: [(generated tokens, score)], best first."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=k,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos,
            pad_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # each one's generated tokens
    seqs = out.sequences[:, len(prompt) :].tolist()
    scores = out.sequences_scores.tolist()
    return [(s[:n], score) for s, n, score in zip(seqs, lengths, scores, strict=True)]


def _check(llm, hf, prompts, eos) -> None:
    for k, penalty, early in SETTINGS:
        params = BeamSearchParams(
            beam_width=k, max_tokens=MAX_TOKENS, length_penalty=penalty, early_stopping=early
        )
        results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, result in zip(prompts, results, strict=True):
            theirs = _transformers(hf, prompt, eos, k, penalty, early)
            ours = [(s.tokens[len(prompt) :], s.score) for s in result.sequences]
            where = f"k={k} length_penalty={penalty} early_stopping={early} prompt={len(prompt)}"
            assert [t for t, _ in ours] == [t for t, _ in theirs], where
            np.testing.assert_allclose(
                [s for _, s in ours], [s for _, s in theirs], rtol=1e-4, atol=1e-4, err_msg=where
            )
            for s in result.sequences:
                generated = s.tokens[len(prompt) :]
                assert s.score == beam_score(s.cum_logprob, len(generated), penalty)
                assert s.finish_reason == ("stop" if generated[-1] == eos else "length")


@pytest.mark.slow
def test_beam_search_matches_transformers(model):
    path, hf, prompts, eos = model
    with LLM(path, num_kv_pages=29, warmup=False, **SMALL) as llm:
        engine = llm.engine
        _check(llm, hf, prompts, eos)
        assert engine.scheduler.num_preemptions > 0  # beams preempted, recomputed
        hits = engine.scheduler.prefix_hits
        _check(llm, hf, prompts, eos)  # the prompts now hit the prefix cache
        assert engine.scheduler.prefix_hits > hits
        engine.scheduler.check_invariant()
        assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.slow
def test_beams_ended_by_eos_and_nothing_compiled_after_warm_up(model):
    """Forks, page copies and preemptions, with every program compiled at warm-up
    (`compile_guard`: a step that compiles raises)."""
    path, _, prompts, _ = model
    with LLM(path, num_kv_pages=29, warmup=True, compile_guard=True, **SMALL) as llm:
        runner = llm.engine.runner
        compiled = runner.compiles.count
        reasons = set()
        for penalty in (1.0, -1.0):  # (a negative one ranks short, EOS-ended beams first)
            params = BeamSearchParams(beam_width=8, max_tokens=MAX_TOKENS, length_penalty=penalty)
            results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
            reasons |= {s.finish_reason for r in results for s in r.sequences}
        assert runner.compiles.count == compiled
        assert llm.engine.scheduler.num_preemptions > 0
        assert reasons == {"stop", "length"}


def test_beam_search_is_refused_on_a_hybrid_kv_cache(hf_model_dir):
    """Sliding-window layers with pages of their own: beam search is refused naming
    the field and the way out; the engine serves on."""
    path, _ = hf_model_dir("gemma3_local_global_rope")
    small = {**SMALL, "disable_hybrid_kv_cache_manager": False}
    with LLM(path, num_kv_pages=29, warmup=False, **small) as llm:
        assert llm.engine.config.hybrid_kv
        params = BeamSearchParams(beam_width=2, max_tokens=4)
        with pytest.raises(ParamError, match="disable_hybrid_kv_cache_manager=True") as e:
            llm.beam_search([{"prompt_token_ids": [5, 6, 7, 8]}], params)
        assert e.value.field == "beam" and not llm.engine.requests
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) > 0
