"""`LLM`: the offline API, in the shape of vLLM's."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh
from tqdm import tqdm

from jaxserve.assets import DEFAULT_MODEL, EMBEDDED_MODELS
from jaxserve.config import CacheConfig, EngineConfig, ModelConfig
from jaxserve.engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

PromptType = str | dict[str, Any]

# JAX's persistent compilation cache: a restart reuses compiled step programs.
DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")


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

    With no model, the embedded demo model is used. Offline runs compile step
    programs as their shapes first occur; `warmup=True` compiles every bucket
    up front, as a server does.

    >>> llm = LLM(model="path/to/model", dtype="float32")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        num_kv_pages: int | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        kv_cache_memory_fraction: float | None = None,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        seed: int = 0,
        warmup: bool = False,
        compile_guard: bool = False,
        compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE,
        debug_preemption_rate: float = 0.0,
        mesh: Mesh | None = None,
        **engine_options,
    ):
        """Arguments as vLLM's; `engine_options` are further `EngineConfig` fields."""
        model_dir = resolve_model_dir(model)
        self.config = EngineConfig(
            model_dir=model_dir,
            model=ModelConfig.from_pretrained(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            cache=CacheConfig(
                page_size=block_size,
                num_pages=num_kv_pages,
                memory_bytes=kv_cache_memory_bytes,
                memory_fraction=kv_cache_memory_fraction,
            ),
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
            seed=seed,
            warmup=warmup,
            compile_guard=compile_guard,
            compilation_cache_dir=compilation_cache_dir,
            debug_preemption_rate=debug_preemption_rate,
            **engine_options,
        )
        self.tokenizer = Tokenizer(model_dir)
        self.engine = LLMEngine(self.config, self.tokenizer, mesh)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; results come back in the prompts' order.

        A prompt is text, or {"prompt_token_ids": [...]} (optionally with "prompt").
        All prompts are validated before any is queued, so a bad one changes nothing.
        If interrupted, the requests still running are aborted and their pages freed.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        requests = [(str(next(self._ids)), *self._tokenize(p, i)) for i, p in enumerate(prompts)]
        added = []
        for i, ((request_id, text, ids), sp) in enumerate(zip(requests, params, strict=True)):
            try:
                self.engine.add_request(
                    request_id,
                    ids,
                    sp,
                    prompt=text,
                    cache_salt=cache_salt,
                    priority=0 if priority is None else priority[i],
                )
            except ValueError as e:
                for earlier in added:
                    self.engine.abort(earlier)
                raise ValueError(f"prompts[{i}]: {e}") from e
            added.append(request_id)
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(
                total=len(requests),
                desc="generate",
                unit="req",
                disable=not use_tqdm,
                mininterval=1,
            ) as bar:
                while len(results) < len(requests):
                    for out in self.engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        finally:
            for request_id in added:
                if request_id not in results:
                    self.engine.abort(request_id)
        return [results[request_id] for request_id, _, _ in requests]

    def _tokenize(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError(
            f"prompts[{index}] must be a string or a dict with 'prompt_token_ids', got {prompt!r}"
        )
