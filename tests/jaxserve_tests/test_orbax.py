"""Orbax model directories: `jaxserve convert` output loads to the same logits as the
safetensors directory, and restores each shard straight to its device."""

import dataclasses
import json
import os

import pytest
from fake_devices import run_on_8_devices

from jaxserve.assets import EMBEDDED_MODELS
from jaxserve.checkpoint import convert, is_orbax_dir
from server.cli import main as cli

DEMO = EMBEDDED_MODELS["demo-model"]


@pytest.fixture(scope="module")
def orbax_demo(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo-orbax") / "model")
    convert(DEMO, out)
    return out


def test_convert_writes_a_complete_model_directory(orbax_demo):
    names = set(os.listdir(orbax_demo))
    assert {"config.json", "tokenizer.json", "generation_config.json", "orbax"} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    assert is_orbax_dir(orbax_demo) and not is_orbax_dir(DEMO)
    with open(os.path.join(orbax_demo, "jaxserve_checkpoint.json")) as f:
        assert json.load(f)["dtype"] == "float32"


def test_llm_on_an_orbax_directory_generates_what_safetensors_does(orbax_demo):
    from jaxserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=32, warmup=False)
    texts = [
        LLM(d, **kw).generate(["Once upon a time"], params, use_tqdm=False)
        for d in (DEMO, orbax_demo)
    ]
    assert texts[0][0].outputs[0].token_ids == texts[1][0].outputs[0].token_ids


@pytest.mark.sharded
def test_orbax_restore_equals_safetensors_and_reads_each_shard_once(orbax_demo):
    stdout = run_on_8_devices("orbax_check.py", DEMO, orbax_demo)
    assert "tp=4: orbax logits equal safetensors logits" in stdout, stdout
    assert "tp=8: restore read" in stdout, stdout


@pytest.mark.parametrize(
    "args,error",
    [
        (["--quantization=int3"], "quantization must be one of ['fp8', 'int4', 'int8']"),
        (["--quantization="], "exists and is not empty"),
    ],
)
def test_convert_command_errors_name_the_problem(orbax_demo, args, error):
    # absl keeps flag values between runs in one process: each run sets all it reads.
    output = orbax_demo if args == ["--quantization="] else orbax_demo + "-q"
    with pytest.raises(SystemExit) as e:
        cli.run(["jaxserve", "convert", f"--model={DEMO}", f"--output={output}", *args])
    assert error in str(e.value)


def test_restore_refuses_a_config_that_does_not_match(orbax_demo):
    from jaxserve.checkpoint import load_model
    from jaxserve.config import ModelConfig

    config = ModelConfig.from_pretrained(orbax_demo)
    wrong = dataclasses.replace(config, intermediate_size=config.intermediate_size * 2)
    with pytest.raises(ValueError, match="has shape"):
        load_model(orbax_demo, wrong)


def test_an_int8_orbax_directory_serves_what_load_time_int8_does(orbax_demo, tmp_path):
    """`convert --quantization=int8` stores the int8 arrays (about a quarter of the
    bytes) and says so in config.json; loading it needs no quantization argument and
    gives load-time quantization's tokens."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import ModelConfig

    out = str(tmp_path / "int8")
    with pytest.raises(SystemExit) as done:  # absl's app.run exits
        cli.run(
            ["jaxserve", "convert", f"--model={DEMO}", f"--output={out}", "--quantization=int8"]
        )
    assert not done.value.code
    assert ModelConfig.from_pretrained(out).quantization == "int8"

    def stored(d):
        return sum(
            os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(os.path.join(d, "orbax"))
            for f in fs
        )

    assert stored(out) < 0.35 * stored(orbax_demo)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=32, warmup=False)
    prompts = ["Once upon a time", "def f(x):"]
    from_dir = LLM(out, **kw)
    assert from_dir.config.quantization == "int8"
    at_load = LLM(DEMO, quantization="int8", **kw)
    for a, b in zip(
        from_dir.generate(prompts, params, use_tqdm=False),
        at_load.generate(prompts, params, use_tqdm=False),
        strict=True,
    ):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="stored quantized already"):
        convert(out, str(tmp_path / "again"), quantization="int8")


def test_restore_refuses_int8_arrays_of_the_older_layout(orbax_demo, tmp_path):
    """Format 1 stored int8 linear kernels [in, out]; square ones would load transposed
    without an error, so such a directory is refused; unquantized format 1 still loads."""
    import shutil

    from jaxserve.checkpoint import load_model
    from jaxserve.config import ModelConfig

    old = str(tmp_path / "v1")
    shutil.copytree(orbax_demo, old)
    marker = os.path.join(old, "jaxserve_checkpoint.json")
    with open(marker) as f:
        content = json.load(f)
    with open(marker, "w") as f:
        json.dump({**content, "format_version": 1}, f)
    load_model(old, ModelConfig.from_pretrained(old))  # unquantized: the same arrays
    with open(marker, "w") as f:
        json.dump({**content, "format_version": 1, "quantization": "int8"}, f)
    config = dataclasses.replace(ModelConfig.from_pretrained(old), quantization="int8")
    with pytest.raises(ValueError, match="format 1 with int8 weights.*jaxserve convert"):
        load_model(old, config)
