"""`jaxserve generate`: offline generation for one prompt or a JSONL file of prompts.

  jaxserve generate --prompt="Return the number of" --max_tokens=32   (embedded demo model)
  jaxserve generate --model=DIR --input=prompts.jsonl --output=results.jsonl

Each input line is {"prompt": "..."}, {"prompt_token_ids": [...]} or
{"messages": [...]} (rendered with the model's chat template), optionally with
"sampling_params": {...} overriding the sampling flags for that line.

Results are written as each request finishes, one JSON line each with the
input's line `index`, so an interrupted run keeps everything finished so far.
Every line is checked before the engine's warm-up: a bad one (not JSON, a bad
field, a prompt the engine cannot take) is logged with its line number and
skipped; the others run, and the command then exits non-zero saying how many
were skipped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time

from absl import flags
from tqdm import tqdm

from jaxserve.generate_request import GenerateRequest
from jaxserve.inputs import parse_prompt
from jaxserve.llm import LLM
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import FIELDS, RequestOutputKind, SamplingParams
from server.cli import logs
from server.cli.engine_flags import engine_kwargs

FLAGS = flags.FLAGS
flags.DEFINE_string("prompt", None, "One prompt to complete (or use --input).")
flags.DEFINE_string("input", None, "JSONL file of prompts.")
flags.DEFINE_string("output", None, "JSONL file for the results (default: stdout).")
# Sampling options: the defaults of SamplingParams, except greedy by default.
flags.DEFINE_integer("n", 1, "Samples per prompt.")
flags.DEFINE_float("temperature", 0.0, "0 is greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
flags.DEFINE_integer("top_k", 0, "Top-k sampling (0: off).")
flags.DEFINE_float("min_p", 0.0, "Min-p sampling.")
flags.DEFINE_float("presence_penalty", 0.0, "OpenAI presence penalty.")
flags.DEFINE_float("frequency_penalty", 0.0, "OpenAI frequency penalty.")
flags.DEFINE_float("repetition_penalty", 1.0, "Repetition penalty (1: off).")
flags.DEFINE_integer("sampling_seed", None, "Per-request seed for reproducible sampling.")
flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
flags.DEFINE_list("stop_token_ids", [], "Comma-separated token ids that stop generation.")
flags.DEFINE_bool("include_stop_str_in_output", False, "Keep the stop string in the text.")
flags.DEFINE_bool("ignore_eos", False, "Keep generating past EOS.")
flags.DEFINE_integer("max_tokens", 64, "Tokens to generate per prompt.")
flags.DEFINE_integer("min_tokens", 0, "Tokens to generate before EOS or a stop may end it.")
flags.DEFINE_integer("logprobs", None, "Top logprobs to return per generated token.")
flags.DEFINE_bool("skip_special_tokens", True, "Leave special tokens out of the text.")


# SamplingParams fields whose flag has another name (--seed is absl's own), and those
# with no flag: a JSONL record gives them in its "sampling_params" object.
_FLAG_NAMES = {"seed": "sampling_seed"}
_RECORD_ONLY = frozenset({"prompt_logprobs", "logit_bias", "structured_outputs", "detokenize"})


def sampling_kwargs() -> dict:
    """Every SamplingParams field from its flag (`FIELDS`; `test_cli.py` checks that
    each has one, or is a record-only field)."""
    kw = {
        name: FLAGS[_FLAG_NAMES.get(name, name)].value
        for name in FIELDS
        if name not in _RECORD_ONLY
    }
    try:
        kw["stop_token_ids"] = [int(t) for t in kw["stop_token_ids"]]
    except ValueError:
        raise SystemExit(f"--stop_token_ids must be integers, got {FLAGS.stop_token_ids}") from None
    return kw


def _read_inputs() -> tuple[list[tuple[int, str, dict]], list[str]]:
    """The input records, each with its index (among the input's non-empty lines) and
    where it comes from ("FILE:LINE"), and the lines that are not one (each named,
    with why)."""
    if (FLAGS.prompt is None) == (FLAGS.input is None):
        raise SystemExit("give exactly one of --prompt and --input")
    if FLAGS.prompt is not None:
        return [(0, "--prompt", {"prompt": FLAGS.prompt})], []
    records, bad = [], []
    with open(FLAGS.input) as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        for index, (n, line) in enumerate(lines):
            where = f"{FLAGS.input}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                bad.append(f"{where}: not JSON: {e}")
                continue
            if isinstance(record, str):
                record = {"prompt": record}
            if not isinstance(record, dict):
                bad.append(f"{where}: expected an object or a string")
                continue
            records.append((index, where, record))
    return records, bad


def _to_request(llm: LLM, index: int, record: dict, base: dict) -> GenerateRequest:
    """One input record's request, checked against the engine (raises ValueError or
    TypeError naming the field)."""
    record = dict(record)
    overrides = record.pop("sampling_params", None) or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"sampling_params must be an object, got {overrides!r:.40}")
    final = RequestOutputKind.FINAL_ONLY  # (only the finished outputs are written)
    params = SamplingParams(**{**base, **overrides, "output_kind": final})
    prompt = parse_prompt(record, llm.tokenizer)
    request = GenerateRequest(str(index), prompt.token_ids, params, prompt=prompt.text)
    llm.engine.validate(request)
    return request


def main(argv) -> None:
    del argv
    logs.configure()
    try:
        bad = _generate()
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise SystemExit(f"jaxserve generate: {e}") from None
    if bad:
        raise SystemExit(
            f"jaxserve generate: {bad} input line(s) skipped (named above); the others' "
            "results are written"
        )


def _generate() -> int:
    """Runs every good input; returns how many were skipped (each logged, named)."""
    records, bad = _read_inputs()
    base = sampling_kwargs()
    try:  # the sampling flags, before anything loads
        SamplingParams(**base)
    except ValueError as e:
        raise SystemExit(f"jaxserve generate: {e}") from None
    kw = engine_kwargs()
    # The inputs are checked against the engine before its warm-up (a bad line costs
    # none); an engine of replicas or processes warms up as it is built.
    deferred = kw["warmup"] and kw["data_parallel_size"] == 1 and kw["num_processes"] == 1
    with LLM(FLAGS.model, **{**kw, "warmup": kw["warmup"] and not deferred}) as llm:
        requests = []
        for index, where, record in records:
            try:
                requests.append(_to_request(llm, index, record, base))
            except (ValueError, TypeError) as e:
                bad.append(f"{where}: {e}")
        for line in bad:
            logging.error("skipped %s", line)
        if not requests:
            raise ValueError("no input to run: every line was skipped")
        if deferred:
            llm.engine.warm_up()
        _generate_all(llm, requests)  # (a disk KV tier is saved as the LLM closes)
    return len(bad)


def _generate_all(llm: LLM, requests: list[GenerateRequest]) -> None:
    engine = llm.engine
    for request in requests:
        engine.add_request(request)

    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    counts = {"generated": 0, "written": 0}
    t0 = time.perf_counter()
    to_file = FLAGS.output is not None
    with (
        open(FLAGS.output, "w") if to_file else contextlib.nullcontext(sys.stdout) as out,
        tqdm(total=len(requests), desc="generate", unit="req", disable=not to_file) as bar,
    ):

        def write(r: RequestOutput) -> None:
            if not r.finished:
                return
            for c in r.outputs:
                counts["generated"] += len(c.token_ids)
                record = {
                    "index": int(r.request_id),
                    "prompt": r.prompt,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                }
                if len(r.outputs) > 1:
                    record["sample"] = c.index
                if c.logprobs is not None:
                    record["logprobs"] = [{str(k): v for k, v in lp.items()} for lp in c.logprobs]
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            counts["written"] += 1

        try:
            engine.run(write, progress=bar)
        except KeyboardInterrupt:  # the loop has aborted what was unfinished
            logging.warning(
                "interrupted: %d of %d results written", counts["written"], len(requests)
            )
    elapsed = time.perf_counter() - t0
    logging.info(
        "%d requests in %.2fs: %.2f req/s, %.1f prompt tokens/s, %.1f generated tokens/s",
        counts["written"],
        elapsed,
        counts["written"] / elapsed,
        prompt_tokens / elapsed,
        counts["generated"] / elapsed,
    )
