"""The embedded demo models: trained, small, loadable by transformers, the default."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from engine_utils import demo_validation_ids, engine_config, prompt_logits

from jaxserve import LLM, SamplingParams
from jaxserve.assets import DEFAULT_MODEL, EMBEDDED_MODELS
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _report(name):
    with open(os.path.join(EMBEDDED_MODELS[name], "training_report.json")) as f:
        return json.load(f)


def test_shipped_files_are_small_and_complete():
    total = 0
    for path in EMBEDDED_MODELS.values():
        names = set(os.listdir(path))
        assert {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "training_report.json",
        } <= names
        total += sum(os.path.getsize(os.path.join(path, n)) for n in names)
    assert total < 25 * 2**20, f"{total / 2**20:.1f} MiB shipped"
    with (
        open(os.path.join(EMBEDDED_MODELS["demo-model"], "tokenizer.json")) as a,
        open(os.path.join(EMBEDDED_MODELS["demo-model-tiny"], "tokenizer.json")) as b,
    ):
        assert a.read() == b.read()  # one tokenizer: the tiny model can draft for the big one


WINDOW = 128  # the training script's evaluation windows: 128 tokens predicted each
REPORTED_WINDOWS = 64  # those its report averages over: whole batches of 32 windows


def heldout_nll(name: str) -> np.ndarray:
    """The model's negative log-likelihood of each window of the held-out text shipped
    in tests/data, computed here through the engine's own forward: each window of
    WINDOW + 1 tokens in one step, every next token scored. [windows, WINDOW]"""
    ids = np.asarray(demo_validation_ids())
    runner = ModelRunner(engine_config(EMBEDDED_MODELS[name], page_size=16, max_model_len=256))
    pages = list(range(1, (WINDOW + 1) // 16 + 2))
    nll = []
    for start in range(0, len(ids) - WINDOW, WINDOW):
        window = ids[start : start + WINDOW + 1]
        logits = prompt_logits(runner, window[:-1].tolist(), pages).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll.append(-logprobs[np.arange(WINDOW), window[1:]])
    return np.stack(nll)


def test_models_are_trained_not_random():
    vocab = Tokenizer(EMBEDDED_MODELS["demo-model"]).vocab_size
    nll = {name: heldout_nll(name) for name in ("demo-model", "demo-model-tiny")}
    assert len(nll["demo-model"]) == 92  # 11,885 held-out tokens
    big, tiny = (float(np.exp(n.mean())) for n in nll.values())
    # A random model's perplexity is about the vocabulary size (4,096); these ~63 and ~61.
    assert big < vocab / 40 and tiny < vocab / 20, (big, tiny)
    # The training reports say what these weights gave on the windows they average.
    for name, n in nll.items():
        reported = _report(name)["val_perplexity"]
        assert np.exp(n[:REPORTED_WINDOWS].mean()) == pytest.approx(reported, rel=0.01), name
    assert _report("demo-model-tiny")["parameters"] * 3 < _report("demo-model")["parameters"]
    assert _report("demo-model")["parameters"] < 10_000_000


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_transformers_loads_the_same_directory_and_agrees(name):
    path = EMBEDDED_MODELS[name]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    text = "Return the number of items in the list."
    ids = Tokenizer(path).encode(text)
    assert ids == hf_tok.encode(text)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    runner = ModelRunner(engine_config(path, page_size=16, max_model_len=512))
    got = prompt_logits(runner, ids, [1])
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_default_llm_generates_english():
    llm = LLM()  # no model: the embedded default
    assert llm.config.model_dir == EMBEDDED_MODELS[DEFAULT_MODEL]
    out = llm.generate(
        ["The function returns"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )[0].outputs[0]
    words = out.text.split()
    assert len(words) >= 10, out.text
    english = {"the", "a", "of", "to", "is", "and", "in", "if", "be", "for", "it", "this"}
    assert sum(w.lower().strip(".,:;()") in english for w in words) >= 3, out.text


@pytest.mark.slow
def test_training_script_runs_end_to_end(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "train_demo_model.py"),
            f"--out_dir={tmp_path}",
            "--steps_scale=0.003",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in EMBEDDED_MODELS:
        report = json.loads((tmp_path / name / "training_report.json").read_text())
        assert report["corpus"]["license"] == "PSF-2.0" and report["steps"] >= 1
        out = LLM(str(tmp_path / name), warmup=False).generate(
            ["a"], SamplingParams(temperature=0, max_tokens=4)
        )
        assert len(out[0].outputs[0].token_ids) >= 1
