"""`LLM`: the offline API, in the shape of vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from jax.sharding import Mesh
from tqdm import tqdm

from jaxserve.assets import DEFAULT_MODEL, EMBEDDED_MODELS
from jaxserve.beam_search import beam_score
from jaxserve.config import ModelConfig, engine_config
from jaxserve.distributed import multihost
from jaxserve.distributed.data_parallel import DataParallelEngine, data_parallel_engine, stream_all
from jaxserve.engine import LLMEngine
from jaxserve.engine.startup import use_compilation_cache
from jaxserve.generate_request import GenerateRequest
from jaxserve.inputs import PromptType, parse_prompt
from jaxserve.lora import LoRARequest
from jaxserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from jaxserve.sampling_params import (
    BeamSearchParams,
    ParamError,
    RequestOutputKind,
    SamplingParams,
)
from jaxserve.tokenizer import Tokenizer
from pallas_kernels.cpu import cache as kernel_cache

# JAX's persistent compilation cache for the command line and `LLM` (a restart reuses
# compiled step programs: 9 s instead of 82 s for the demo model).
DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")


def _default_logging() -> None:
    """What the command line logs (the model, its KV capacity, warm-up), at INFO on
    stderr, as vLLM's LLM does; unless the program configured logging itself (a handler
    on the root logger or on jaxserve's), which then decides."""
    ours = logging.getLogger("jaxserve")
    if ours.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def _prompt_error(i: int, e: ValueError) -> ParamError:
    """`e` about the call's prompt `i`: its message says which, its field stays."""
    return ParamError(getattr(e, "field", None), f"prompts[{i}]: {e}")


def _per_prompt_loras(lora_request, num_prompts: int) -> list:
    """`generate`'s lora_request as one adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ParamError("lora", f"got {len(loras)} lora_requests for {num_prompts} prompts")
    return loras


def resolve_model_dir(model: str | os.PathLike | None) -> str:
    """A local Hugging Face model directory, or an embedded model's name (no downloads)."""
    if model is None:
        model = DEFAULT_MODEL
    path = os.fspath(model)
    if path in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[path]
    if not os.path.isdir(path):
        raise ValueError(
            f"model {path!r} is not a directory nor an embedded model {sorted(EMBEDDED_MODELS)}; "
            "pass a local Hugging Face model directory (config.json, *.safetensors, "
            "tokenizer.json)"
        )
    return path


class LLM:
    """Offline generation over a local Hugging Face model directory.

    With no model, the embedded demo model is used. Every step program is compiled
    (or loaded from the persistent compilation cache) before the constructor
    returns, so no request waits for a compilation; `warmup=False` compiles each
    program when its shape first occurs instead. `tokenizer` names another
    directory to load the tokenizer from; `skip_tokenizer_init=True` loads none
    (prompts and outputs are token ids only, as in vLLM).

    `compiled` names a bundle of compiled programs (`save_compiled`, or `jaxserve
    preflight --output` for a TPU or GPU): start-up loads them and compiles nothing.
    A bundle made for another target, jax version, code or configuration is refused
    with a ValueError naming each difference.

    `compilation_cache_dir` is JAX's persistent compilation cache (default:
    DEFAULT_COMPILATION_CACHE, the command line's): a later start, in any process,
    loads the programs instead of compiling them. The setting is JAX's, process-wide,
    for the rest of the process; the default leaves a cache the process already set
    (JAX_COMPILATION_CACHE_DIR, an earlier LLM) as it is, and None changes no JAX
    setting (no cache).

    `close()` (or `with LLM(...) as llm:`) releases the engine: its threads, JAX
    monitoring listeners, KV tier and device buffers (weights, KV caches), and
    data-parallel replicas (their threads, or their Ray actors).

    >>> with LLM(model="path/to/model", dtype="float32") as llm:
    ...     out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        tokenizer: str | os.PathLike | None = None,
        skip_tokenizer_init: bool = False,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        seed: int = 0,
        logprobs_mode: str = "raw_logprobs",
        warmup: bool = True,
        compilation_cache_dir: str | os.PathLike | None = DEFAULT_COMPILATION_CACHE,
        compiled: str | os.PathLike | None = None,
        mesh: Mesh | None = None,
        **engine_args,
    ):
        """Arguments as vLLM's; `engine_args` are further `jaxserve.config.ENGINE_ARGS`
        (num_kv_pages, kv_cache_memory_fraction, tensor_parallel_size, ...).

        `logprobs_mode` (vLLM's): what `logprobs` and `prompt_logprobs` hold, for the
        engine's life: "raw_logprobs" (the model's), "raw_logits", "processed_logprobs"
        (the distribution each token was sampled from) or "processed_logits"
        (`jaxserve.runner.sampler` says exactly what each holds)."""
        import jax

        _default_logging()
        model_dir = resolve_model_dir(model)
        configured = jax.config.values.get("jax_compilation_cache_dir")
        if compilation_cache_dir == DEFAULT_COMPILATION_CACHE and configured:
            compilation_cache_dir = configured  # the process's own, kept
        if compilation_cache_dir is not None:
            compilation_cache_dir = os.path.expanduser(os.fspath(compilation_cache_dir))
        # The CPU kernels' per-user build cache, unless given (None: private, rebuilt).
        engine_args.setdefault("native_kernels_dir", kernel_cache.default_dir(os.environ))
        spec = engine_args.get("speculative_config")
        if isinstance(spec, dict) and spec.get("model") is not None:  # a draft model's name
            engine_args["speculative_config"] = {**spec, "model": resolve_model_dir(spec["model"])}
        self.config = engine_config(
            model_dir,
            ModelConfig.from_pretrained(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
            seed=seed,
            logprobs_mode=logprobs_mode,
            warmup=warmup,
            compilation_cache_dir=compilation_cache_dir,
            compiled_dir=None if compiled is None else os.fspath(compiled),
            **engine_args,
        )
        self.closed = False
        # JAX's cache, process-wide. (A bundle's programs never touch it.)
        if compilation_cache_dir and compiled is None:
            use_compilation_cache(compilation_cache_dir)
        parallel = self.config.parallel
        heartbeat = multihost.initialize(parallel)  # before anything touches a device
        self.follower = self.leader = None
        if parallel.process_id != 0:  # a follower: its shards and programs, no engine
            self.tokenizer = self.engine = None
            self.follower = multihost.Follower(heartbeat)
            self._follower_runner = multihost.follower_runner(self.config, self.follower)
            return
        # Multi-host: each step's plan goes to the followers first.
        if heartbeat is not None:
            self.leader = multihost.Leader(heartbeat)
        tokenizer_dir = None if skip_tokenizer_init else resolve_model_dir(tokenizer or model_dir)
        self.tokenizer = Tokenizer(tokenizer_dir) if tokenizer_dir else None
        if self.config.parallel.data_parallel_size > 1:
            if mesh is not None:
                raise ValueError(
                    "mesh= is one engine's devices; with data_parallel_size="
                    f"{self.config.parallel.data_parallel_size} each replica takes its own slice"
                )
            # Replicas behind a router, each with its engine thread (distributed/data_parallel.py).
            self.engine = data_parallel_engine(self.config, self.tokenizer, tokenizer_dir)
        elif self.leader is not None:
            self.engine = LLMEngine(
                self.config,
                self.tokenizer,
                mesh,
                plan_sink=self.leader.send,
                step_wait=self.leader.wait,
            )
        else:
            self.engine = LLMEngine(self.config, self.tokenizer, mesh)
        self._ids = itertools.count()

    def close(self) -> None:
        """Releases the engine (`LLMEngine.close`, or the data-parallel replicas' with
        their threads or Ray actors), a multi-host leader's plan thread or a follower's
        runner. Idempotent; `generate` raises after it."""
        if self.closed:
            return
        self.closed = True
        if self.engine is not None:
            self.engine.close()
        if self.leader is not None:
            self.leader.close()
        if self.follower is not None:
            self.follower.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def save_compiled(self, directory: str | os.PathLike) -> int:
        """Writes this engine's compiled programs (warm-up's) with their manifest into
        `directory`: a bundle for `LLM(..., compiled=directory)` on this machine's
        platform (for a TPU or GPU from here: `jaxserve preflight --output`). Returns
        the bytes written."""
        return self._one_engine("save_compiled").save_compiled(os.fspath(directory))

    def update_weights(
        self,
        params=None,
        *,
        path: str | os.PathLike | None = None,
        weight_version: int | None = None,
    ) -> int:
        """Serves new weights from the next `generate` on; returns their version.
        `LLMEngine.update_weights` says what `params` and `path` (a model directory, or
        an embedded model's name) may be, and what happens to cached KV. Data-parallel
        replicas are all updated, to one version (`DataParallelEngine.update_weights`;
        Ray replicas take a `path` only); a multi-host engine refuses it (the other
        processes' weights would not change)."""
        if path is not None:
            path = EMBEDDED_MODELS.get(os.fspath(path), os.fspath(path))
        if isinstance(self.engine, DataParallelEngine):
            update = self.engine.update_weights(params, path=path, weight_version=weight_version)
            return self.engine.run_sync(update)
        engine = self._one_engine("update_weights")
        return engine.update_weights(params, path=path, weight_version=weight_version)

    def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache's pages and the KV tier's (`LLMEngine.reset_prefix_cache`;
        every data-parallel replica's); True once done."""
        if isinstance(self.engine, DataParallelEngine):
            return self.engine.run_sync(self.engine.reset_prefix_cache())
        return self._one_engine("reset_prefix_cache").reset_prefix_cache()

    def sleep(self, level: int = 1, keep_host_copy: bool = True) -> None:
        """Gives the device memory back between `generate` calls (beside a trainer):
        level 1 the KV cache, level 2 the weights too, kept in host memory unless
        `keep_host_copy` is False (`jaxserve.engine.lifecycle`). `generate` raises
        EngineUnavailableError until `wake_up`. (Pausing is for servers: `generate`
        returns only when its requests are done, so there is nothing to pause.)"""
        if isinstance(self.engine, DataParallelEngine):
            self.engine.run_sync(self.engine.sleep(level, keep_host_copy))
        else:
            self._one_engine("sleep").sleep(level, keep_host_copy)

    def wake_up(self) -> None:
        """Takes the device memory again after `sleep` (nothing is compiled again)."""
        if isinstance(self.engine, DataParallelEngine):
            self.engine.run_sync(self.engine.wake_up())
        else:
            self._one_engine("wake_up").wake_up()

    def _one_engine(self, what: str) -> LLMEngine:
        """The engine in this process; refused for data-parallel replicas (where the
        caller does not go through their front) and a multi-host follower."""
        if self.closed:
            raise RuntimeError("this LLM is closed")
        if self.engine is None:
            raise ValueError(f"{what}() is the leader's (process_id 0); this is a follower")
        if not isinstance(self.engine, LLMEngine):
            raise ValueError(
                f"{what}() is for one engine in this process, not data-parallel replicas "
                f"(data_parallel_size={self.config.parallel.data_parallel_size})"
            )
        return self.engine

    def follow(self) -> int:
        """A follower process (process_id > 0): runs the leader's steps until the
        leader stops (`LLM.stop_followers` there, or its interpreter exits); returns
        the steps run. Raises `multihost.LeaderLostError` if the leader is dead or
        stalled for `step_timeout_s`."""
        if self.follower is None:
            raise ValueError("follow() is for followers (process_id > 0)")
        return self.follower.run(self._follower_runner)

    def stop_followers(self) -> None:
        """The leader of a multi-host engine: let the followers' `follow()` return
        once they have run the steps sent before (done at exit if not called)."""
        if self.leader is not None:
            self.leader.stop_followers()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; results come back in the prompts' order.

        `lora_request` (an engine with enable_lora): the LoRA adapter of every prompt,
        or a list of one per prompt (None: the base model), as in vLLM.

        A prompt is text, {"prompt": text}, {"prompt_token_ids": [...]} (optionally
        with "prompt") or {"messages": [...]} (`jaxserve.inputs`). All prompts are
        validated before any is queued, so a bad one changes nothing.
        If interrupted, the requests still running are aborted and their pages freed.
        """
        parsed = self._parse(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(parsed)
        else:
            params = list(sampling_params)
            if len(params) != len(parsed):
                raise ValueError(f"got {len(params)} sampling_params for {len(parsed)} prompts")
        if priority is not None and len(priority) != len(parsed):
            raise ValueError(f"got {len(priority)} priorities for {len(parsed)} prompts")
        loras = _per_prompt_loras(lora_request, len(parsed))
        # Only the final outputs are read: the steps build no others (vLLM's FINAL_ONLY).
        final: dict[int, SamplingParams] = {}
        for sp in params:
            if id(sp) not in final:
                final[id(sp)] = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
        requests = [
            GenerateRequest(
                str(next(self._ids)),
                p.token_ids,
                final[id(sp)],
                prompt=p.text,
                priority=0 if priority is None else priority[i],
                cache_salt=cache_salt,
                lora=loras[i],
            )
            for i, (p, sp) in enumerate(zip(parsed, params, strict=True))
        ]
        return self._run(requests, use_tqdm, "generate")

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best sequences of each
        prompt, best first, ranked as transformers' `generate(num_beams=...)` ranks
        them (`jaxserve.beam_search`). The beams of every prompt run together in the
        continuous batch, sharing their pages copy-on-write. Prompts are as in
        `generate`; all are validated before any is queued."""
        if not isinstance(params, BeamSearchParams):
            raise ParamError("params", f"params must be a BeamSearchParams, got {params!r}")
        parsed = self._parse(prompts)
        requests = [
            GenerateRequest(
                str(next(self._ids)),
                p.token_ids,
                # (n: the hypotheses returned)
                SamplingParams(n=params.beam_width, output_kind=RequestOutputKind.FINAL_ONLY),
                prompt=p.text,
                cache_salt=cache_salt,
                beam=params,
            )
            for p in parsed
        ]
        outputs = self._run(requests, use_tqdm, "beam search")
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        tokens=list(out.prompt_token_ids) + c.token_ids,
                        logprobs=c.logprobs or [],
                        cum_logprob=c.cumulative_logprob or 0.0,
                        text=c.text if self.tokenizer is not None else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        score=beam_score(
                            c.cumulative_logprob or 0.0, len(c.token_ids), params.length_penalty
                        ),
                    )
                    for c in out.outputs
                ]
            )
            for out in outputs
        ]

    def _parse(self, prompts):
        """The call's prompts parsed (token ids, text), each error naming its prompt."""
        if self.closed:
            raise RuntimeError("this LLM is closed")
        if self.engine is None:
            raise ValueError("this is a multi-host follower (process_id > 0): call follow()")
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        parsed = []
        for i, prompt in enumerate(prompts):
            try:
                parsed.append(parse_prompt(prompt, self.tokenizer))
            except ValueError as e:
                raise _prompt_error(i, e) from None
        return parsed

    def _run(self, requests: list[GenerateRequest], use_tqdm: bool, what: str):
        """Queues the requests (all validated first: a bad one changes nothing) and
        steps the engine until every one is finished; their outputs in order."""
        if isinstance(self.engine, DataParallelEngine):
            return self._generate_on_replicas(requests, use_tqdm)
        for i, request in enumerate(requests):
            try:
                self.engine.add_request(request)
            except Exception as e:  # none of this call's requests stays queued
                for earlier in requests[:i]:
                    self.engine.abort(earlier.request_id)
                if isinstance(e, ValueError):
                    raise _prompt_error(i, e) from e
                raise
        results: dict[str, RequestOutput] = {}

        def keep(out: RequestOutput) -> None:
            if out.finished:
                results[out.request_id] = out

        with tqdm(
            total=len(requests), desc=what, unit="req", disable=not use_tqdm, mininterval=1
        ) as bar:
            self.engine.run(keep, progress=bar)
        return [results[request.request_id] for request in requests]

    def _generate_on_replicas(
        self, requests: list[GenerateRequest], use_tqdm: bool
    ) -> list[RequestOutput]:
        """`generate` over data-parallel replicas: every request routed and streamed
        through the `DataParallelEngine`, all at once; results in the prompts' order."""
        for i, request in enumerate(requests):
            try:  # all validated before any is queued
                self.engine.validate(request)
            except ValueError as e:
                raise _prompt_error(i, e) from e

        finals: list[RequestOutput | None] = [None] * len(requests)
        with tqdm(
            total=len(requests), desc="generate", unit="req", disable=not use_tqdm, mininterval=1
        ) as bar:

            def keep(i: int, out: RequestOutput) -> None:
                if out.finished:
                    finals[i] = out
                    bar.update(1)

            stream_all(self.engine, requests, keep)
        return finals
