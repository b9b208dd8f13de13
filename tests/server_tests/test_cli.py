"""`jaxserve generate` as a user runs it."""

import json
import subprocess
import sys

import pytest

from jaxserve import LLM, SamplingParams


def _jaxserve(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "server.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


@pytest.mark.slow
def test_generate_jsonl_matches_the_python_api(tiny_model_dir, tmp_path):
    prompts = [
        {"prompt": "The quick brown fox"},
        {"prompt_token_ids": [1, 40, 50, 60]},
        {"messages": [{"role": "user", "content": "Ça va?"}]},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in prompts) + "\n")
    proc = _jaxserve(
        "generate",
        f"--model={tiny_model_dir}",
        f"--input={src}",
        f"--output={dst}",
        "--max_tokens=8",
        "--ignore_eos",
        "--max_model_len=64",
    )
    assert proc.returncode == 0, proc.stderr
    assert "KV cache:" in proc.stderr and "maximum concurrency" in proc.stderr
    assert "tokens/s" in proc.stderr
    results = sorted(
        (json.loads(line) for line in dst.read_text().splitlines()), key=lambda r: r["index"]
    )
    assert [r["index"] for r in results] == [0, 1, 2]

    llm = LLM(tiny_model_dir, max_model_len=64, warmup=False)
    chat_ids = llm.tokenizer.encode_chat(prompts[2]["messages"])
    assert results[2]["prompt"] == llm.tokenizer.apply_chat_template(prompts[2]["messages"])
    want = llm.generate(
        ["The quick brown fox", prompts[1], {"prompt_token_ids": chat_ids}],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    for got, w in zip(results, want, strict=True):
        assert got["token_ids"] == w.outputs[0].token_ids
        assert got["text"] == w.outputs[0].text
        assert got["finish_reason"] == "length"


def test_usage_errors():
    proc = _jaxserve()
    assert proc.returncode == 2 and "usage: jaxserve <command>" in proc.stdout
    proc = _jaxserve("frobnicate")
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr


@pytest.mark.parametrize(
    "command,own,shared",
    [
        ("generate", "--max_tokens", "--kv_cache_dtype"),
        ("serve", "--metrics_port", "--max_num_seqs"),
        ("bench", "--request_rate", "skip_tokenizer_init"),
        ("client", "--target", None),
    ],
)
def test_help_lists_the_commands_own_flags(command, own, shared):
    """absl's --help listed only the dispatcher's (no) flags and exited 1."""
    proc = _jaxserve(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert own in proc.stdout
    if shared is not None:
        assert shared in proc.stdout


@pytest.mark.slow
def test_generate_with_ngram_speculation_gives_the_same_tokens(tiny_model_dir, tmp_path):
    dst = tmp_path / "out.jsonl"
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": prompt}) + "\n")
    proc = _jaxserve(
        "generate",
        f"--model={tiny_model_dir}",
        f"--input={src}",
        f"--output={dst}",
        "--max_tokens=16",
        "--ignore_eos",
        "--max_model_len=64",
        "--speculative_method=ngram",
        "--num_speculative_tokens=3",
        "--nowarmup",
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(dst.read_text())["token_ids"]
    want = LLM(tiny_model_dir, max_model_len=64, warmup=False).generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    assert got == want[0].outputs[0].token_ids


def test_speculative_flags_become_vllms_speculative_config():
    from absl import flags

    from server.cli import engine_flags

    defaults = {name: flags.FLAGS[name].default for name in engine_flags.ENGINE_FLAGS}
    assert "speculative_config" not in engine_flags.gather_speculative(defaults)
    kw = engine_flags.gather_speculative(
        {**defaults, "speculative_method": "ngram", "num_speculative_tokens": 3}
    )
    assert kw["speculative_config"] == dict(
        method="ngram",
        num_speculative_tokens=3,
        prompt_lookup_min=1,
        prompt_lookup_max=4,
        disable_by_batch_size=8,
    )
    assert not any(name in kw for name in engine_flags.SPECULATIVE_FLAGS)


def test_kv_tier_disk_max_bytes_is_an_engine_flag():
    from absl import flags

    from jaxserve.config import ENGINE_ARGS
    from server.cli import engine_flags

    assert "kv_tier_disk_max_bytes" in engine_flags.ENGINE_FLAGS
    assert "kv_tier_disk_max_bytes" in ENGINE_ARGS
    flag = flags.FLAGS["kv_tier_disk_max_bytes"]
    assert flag.default is None and flag._parse("1073741824") == 1 << 30


@pytest.mark.slow
def test_generate_needs_exactly_one_prompt_source(tiny_model_dir):
    proc = _jaxserve("generate", f"--model={tiny_model_dir}")
    assert proc.returncode != 0 and "exactly one of --prompt and --input" in proc.stderr


@pytest.mark.parametrize("preset", ["cpu", "gpu", "tpu", "cpu-ngram"])
def test_config_presets_name_only_engine_flags(preset):
    import os
    import tomllib

    from server.cli.engine_flags import ENGINE_FLAGS

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    with open(os.path.join(root, "configs", f"{preset}.toml"), "rb") as f:
        assert set(tomllib.load(f)) <= set(ENGINE_FLAGS)


@pytest.mark.slow
def test_default_model_and_sampling_flags(tmp_path):
    """The README's first command: no --model, the embedded demo model answers."""
    args = [
        "generate",
        "--prompt=The function returns",
        "--max_tokens=12",
        "--temperature=0.8",
        "--top_p=0.9",
        "--sampling_seed=3",
        "--n=2",
        "--logprobs=2",
        f"--output={tmp_path / 'out.jsonl'}",
    ]
    proc = _jaxserve(*args)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["sample"] for r in lines) == [0, 1]
    assert all(len(r["logprobs"]) == len(r["token_ids"]) for r in lines)

    want = LLM(warmup=False).generate(
        ["The function returns"],
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, n=2, logprobs=2),
        use_tqdm=False,
    )[0]
    got = {r["sample"]: r["token_ids"] for r in lines}
    assert [got[c.index] for c in want.outputs] == [c.token_ids for c in want.outputs]


def test_a_cpu_machine_hears_nothing_of_other_platforms(tiny_model_dir, tmp_path):
    """With the compile and test extras installed, every command printed the CUDA
    plugin's 30-line "Unable to load CUDA" traceback and libtpu's INVALID_ARGUMENT
    lines on a machine with neither; JAX now asks the CPU alone (JAX_PLATFORMS unset,
    no accelerator device node)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = tmp_path / "out.jsonl"
    args = ["generate", f"--model={tiny_model_dir}", "--prompt=Hi", "--max_tokens=2"]
    proc = _jaxserve(*args, "--warmup=false", f"--output={out}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # ("cudart_stub": CUDA's libraries' "Could not find cuda drivers", 4 lines with 4
    # of absl's pre-init notice, as JAX loaded and found its plugins.)
    noises = ("Unable to load CUDA", "Traceback", "INVALID_ARGUMENT", "libtpu", "cudart_stub")
    for noise in (*noises, "absl::InitializeLog"):
        assert noise not in proc.stderr, (noise, proc.stderr[-3000:])


def test_convert_prints_no_library_bookkeeping(tiny_model_dir, tmp_path):
    """A one-second `convert` printed 56 lines of orbax's INFO (absl's handler let
    every library's INFO through); the libraries now log from WARNING."""
    proc = _jaxserve("convert", f"--model={tiny_model_dir}", f"--output={tmp_path / 'o'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote" in proc.stdout
    for noise in ("checkpoint", "orbax", "ocdbt", "Pytree"):
        assert noise not in proc.stderr, (noise, proc.stderr[-3000:])


@pytest.mark.slow
def test_bad_input_lines_are_named_before_the_warm_up_and_skipped(tiny_model_dir, tmp_path):
    """A bad JSONL line used to abort the whole run after the warm-up, writing
    nothing (issue 42): each is named with its line number before the warm-up, and
    the other lines run."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        '{"prompt": "fine"}\n'
        '{"prompt_token_ids": [99999]}\n'
        "\n"
        "{oops\n"
        '{"prompt": "also fine", "sampling_params": {"temperature": -1}}\n'
        '{"prompt_token_ids": [5, 6, 7]}\n'
    )
    proc = _jaxserve(
        "generate",
        f"--model={tiny_model_dir}",
        f"--input={src}",
        f"--output={dst}",
        "--max_model_len=64",
        "--max_tokens=8",
        "--ignore_eos",
    )
    assert proc.returncode != 0
    err = proc.stderr
    assert f"{src}:2: prompt_token_ids has ids outside the vocabulary" in err
    assert f"{src}:4: not JSON" in err
    assert f"{src}:5: temperature must be >= 0" in err
    assert "3 input line(s) skipped" in err
    # named before the warm-up compiled anything
    assert err.index(f"{src}:5:") < err.index("step programs") < err.index("engine ready")
    written = [json.loads(line) for line in dst.read_text().splitlines()]
    assert sorted(r["index"] for r in written) == [0, 4]  # (indices of non-empty lines)
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 8 for r in written)


def test_every_sampling_field_has_a_flag_or_comes_from_the_record():
    """`jaxserve generate` takes SamplingParams' fields by name (issue 29: one schema):
    a field added there without a flag here fails this test."""
    from absl import flags

    from jaxserve.sampling_params import FIELDS
    from server.cli import generate

    for name in FIELDS:
        if name not in generate._RECORD_ONLY:
            flag = flags.FLAGS[generate._FLAG_NAMES.get(name, name)]
            assert flag.default == getattr(SamplingParams(), name) or name in (
                "temperature",  # greedy by default
                "max_tokens",  # 64
                "stop",
                "stop_token_ids",  # [] flags for None
            ), name
    flags.FLAGS.mark_as_parsed()
    assert SamplingParams(**generate.sampling_kwargs()) == SamplingParams(
        temperature=0.0, max_tokens=64
    )


# The engine flags of this wave's options. (Here, not beside the features' tests: a
# process that imported the engine flags cannot import `jaxserve convert`'s, which
# define --model too, and the CLI imports one command's module per process.)


def test_lora_flags_are_engine_flags_with_the_configs_defaults():
    from absl import flags

    from jaxserve.config import ENGINE_ARGS, LoRAConfig
    from server.cli import engine_flags

    names = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
    assert set(names) <= set(engine_flags.ENGINE_FLAGS) & set(ENGINE_ARGS)
    defaults = LoRAConfig()
    for name in names[:3]:
        assert flags.FLAGS[name].default == getattr(defaults, name)
    assert flags.FLAGS["max_cpu_loras"].default is None  # (max_loras, in the config)


def test_logprobs_mode_flag_is_checked_naming_the_value():
    from absl import flags

    from server.cli import engine_flags

    assert "logprobs_mode" in engine_flags.ENGINE_FLAGS
    with pytest.raises(flags.IllegalFlagValueError, match="processed"):
        flags.FLAGS["logprobs_mode"].parse("processed")
    assert flags.FLAGS["logprobs_mode"].default == "raw_logprobs"


def test_the_hybrid_kv_flag_reaches_the_command_line():
    from server.cli import engine_flags

    assert "disable_hybrid_kv_cache_manager" in engine_flags.ENGINE_FLAGS


def test_flag_names_with_dashes_are_the_same_flags(tmp_path):
    """vLLM's spelling (`--max-tokens 3`, `--no-warmup`) was refused: absl knows only
    `--max_tokens`. Values keep their dashes."""
    dst = tmp_path / "out.jsonl"
    proc = _jaxserve(
        "generate",
        "--model=demo-model-tiny",
        "--prompt=a-b --c-d",
        "--max-tokens",
        "3",
        "--ignore-eos",
        "--max-model-len=64",
        "--no-warmup",
        "--compilation-cache-dir=",
        f"--output={dst}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(dst.read_text())
    assert result["prompt"] == "a-b --c-d" and len(result["token_ids"]) == 3


def test_normalize_flag_names_changes_names_only():
    from absl import flags

    import server.cli.generate  # noqa: F401  (defines the flags below)
    from server.cli.main import normalize_flag_names

    args = [
        "--max-model-len=4096",
        "--dtype",
        "--not-a-value",  # --dtype's value, as given (absl then refuses it)
        "--no-enable-prefix-caching",
        "--noenable-prefix-caching",
        "--enable-lora",
        "--stop=end-of-text",
        "--prompt",
        "--x-y",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "-single-dash",
        "--",
        "--after-the-end",
    ]
    assert normalize_flag_names(args, flags.FLAGS) == [
        "--max_model_len=4096",
        "--dtype",
        "--not-a-value",
        "--noenable_prefix_caching",
        "--noenable_prefix_caching",
        "--enable_lora",
        "--stop=end-of-text",
        "--prompt",
        "--x-y",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "-single-dash",
        "--",
        "--after-the-end",
    ]
