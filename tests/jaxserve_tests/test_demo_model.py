"""The embedded demo models: trained, small, loadable by transformers, the default."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from engine_utils import engine_config, prompt_logits

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


def test_models_are_trained_not_random():
    big, tiny = _report("demo-model"), _report("demo-model-tiny")
    vocab = Tokenizer(EMBEDDED_MODELS["demo-model"]).vocab_size
    # A random model's perplexity is about the vocabulary size.
    assert big["val_perplexity"] < vocab / 40 and tiny["val_perplexity"] < vocab / 20
    assert tiny["parameters"] * 3 < big["parameters"] < 10_000_000


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
