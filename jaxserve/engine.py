"""LLMEngine: requests in, tokens out, one compiled step at a time.

This first engine runs greedy decoding over a ragged batch: each step packs the
running sequences' work (a prefill chunk or one decode token each) under a token
budget into one step. A request reserves the pages it can ever need when it is
admitted, so it never waits for memory mid-flight. The token-budget scheduler
with prefix caching and preemption, and sampling beyond greedy, replace those
simplifications in the engine issue.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.kv import PagePool
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.runner.input_batch import SeqWork
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_ids


class LLMEngine:
    def __init__(
        self, config: EngineConfig, tokenizer: Tokenizer | None = None, mesh: Mesh | None = None
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.runner = ModelRunner(config, mesh)
        self.pool = PagePool(self.runner.num_pages)
        self.waiting: collections.deque[_Sequence] = collections.deque()
        self.running: list[_Sequence] = []
        self.eos_token_ids = set(config.model.eos_token_ids)
        if not self.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids = {tokenizer.eos_token_id}

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        """Validates and queues a request; raises ValueError naming the bad field."""
        if any(s.request_id == request_id for s in (*self.waiting, *self.running)):
            raise ValueError(f"request_id {request_id!r} is already in use")
        _check_supported(params)
        ids = list(prompt_token_ids)
        vocab = self.config.model.vocab_size
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        bad = [t for t in ids if not isinstance(t, int | np.integer) or not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt_token_ids has ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            )
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {limit}, "
                "which must leave room for at least one generated token"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({limit})"
            )
        need = self._pages_needed(len(ids) + max_tokens)
        if need > self.pool.capacity:
            raise ValueError(
                f"request needs {need} KV pages; the whole pool has {self.pool.capacity}"
            )
        self.waiting.append(
            _Sequence(request_id, prompt, [int(t) for t in ids], params, max_tokens)
        )

    def abort(self, request_id: str) -> bool:
        for queue in (self.waiting, self.running):
            for s in queue:
                if s.request_id == request_id:
                    queue.remove(s)
                    self.pool.free(s.pages)
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the requests that finished in it."""
        self._admit()
        if not self.running:
            return []
        budget = self.config.max_num_batched_tokens
        work, scheduled = [], []
        for s in self.running:
            take = min(len(s.token_ids) - s.num_computed, budget)
            if take == 0:
                break
            tokens = s.token_ids[s.num_computed : s.num_computed + take]
            work.append(SeqWork(tokens, s.num_computed, s.pages))
            scheduled.append((s, take))
            budget -= take
        logits = self.runner.execute(self.runner.build(work))
        next_ids = np.asarray(jnp.argmax(logits, axis=-1))
        finished = []
        for i, (s, take) in enumerate(scheduled):
            s.num_computed += take
            if s.num_computed < len(s.token_ids):
                continue  # a prefill chunk: its last logits are not a prediction yet
            s.output_ids.append(int(next_ids[i]))
            s.finish_reason = self._finish_reason(s)
            if s.finish_reason is not None:
                finished.append(s)
        for s in finished:
            self.running.remove(s)
            self.pool.free(s.pages)
        return [self._output(s) for s in finished]

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            s = self.waiting[0]
            need = self._pages_needed(len(s.prompt_token_ids) + s.max_tokens)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            s.pages = self.pool.allocate(need)
            self.running.append(s)

    def _pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.cache.page_size)

    def _finish_reason(self, s: _Sequence) -> str | None:
        last = s.output_ids[-1]
        if len(s.output_ids) >= s.params.min_tokens:
            if last in s.params.stop_token_ids:
                return "stop"
            if not s.params.ignore_eos and last in self.eos_token_ids:
                return "stop"
        if len(s.output_ids) >= s.max_tokens:
            return "length"
        return None

    def _output(self, s: _Sequence) -> RequestOutput:
        ids = s.output_ids
        # A stop token (EOS or stop_token_ids) is returned in token_ids, not rendered.
        text_ids = ids[:-1] if s.finish_reason == "stop" else ids
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(text_ids, skip_special_tokens=s.params.skip_special_tokens)
        completion = CompletionOutput(0, text, list(ids), finish_reason=s.finish_reason)
        return RequestOutput(
            s.request_id, s.prompt, s.prompt_token_ids, [completion], finished=True
        )


def _check_supported(params: SamplingParams) -> None:
    """Rejects what this engine does not do yet, rather than silently ignoring it."""
    unsupported = {
        "temperature": params.temperature != 0.0,
        "n": params.n != 1,
        "logprobs": params.logprobs is not None,
        "prompt_logprobs": params.prompt_logprobs is not None,
        "stop": bool(params.stop),
        "logit_bias": bool(params.logit_bias),
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
    }
    names = [name for name, bad in unsupported.items() if bad]
    if names:
        raise ValueError(
            f"not supported yet: {', '.join(f'{n}={getattr(params, n)!r}' for n in names)}; "
            "this engine decodes greedily (temperature=0) with max_tokens, min_tokens, "
            "ignore_eos and stop_token_ids"
        )
