"""Request results, in the shape of vLLM's offline API."""

from __future__ import annotations

import dataclasses


class Logprob(float):
    """One token's logprob as vLLM's `Logprob` has it (`.logprob`, `.rank`,
    `.decoded_token`), and the number itself: code that reads logprobs as floats (sums,
    JSON, comparisons) works unchanged.

    `rank`: the token's rank among its row's values, vLLM's: how many are at least its
    own (1: the highest); None where unknown. `decoded_token`: its text, decoded when
    first read (None without a tokenizer), so that a caller that never reads it (a
    server writing its own) pays nothing."""

    __slots__ = ("_text", "rank")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        self = super().__new__(cls, logprob)
        self.rank, self._text = rank, decoded_token
        return self

    @classmethod
    def of(cls, logprob: float, rank: int | None, tokenizer, token_id: int) -> Logprob:
        """A logprob whose text `tokenizer` decodes when it is first read."""
        self = cls(logprob, rank)
        if tokenizer is not None:
            self._text = (tokenizer, token_id)
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    @property
    def decoded_token(self) -> str | None:
        if isinstance(self._text, tuple):
            tokenizer, token_id = self._text
            self._text = tokenizer.decode([token_id], skip_special_tokens=False)
        return self._text

    def __reduce__(self):  # (pickled, copied: the text decoded, the tokenizer left)
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""  # text new since the previous output (for streaming)
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Why the engine failed this request (an unexpected error in its host work, named
    # with its cause); its unfinished samples end "abort". None for every other output.
    error: str | None = None
    # The weights' version (`LLMEngine.update_weights`: the caller's number, or a count
    # of updates from 0) that sampled this output's newest tokens, and the one that
    # sampled the request's first output token: a rollout is on-policy for one version
    # when the two are equal.
    weight_version: int = 0
    first_weight_version: int = 0


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What front ends may know about a running engine (`LLMEngine.model_info()`)."""

    model_dir: str
    architecture: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    dtype: str
    kv_cache_dtype: str
    quantization: str | None  # weight quantization ("int8"), None for none
    block_size: int  # tokens per KV page
    kv_cache_tokens: int  # tokens the KV pool holds
    weight_bytes: int  # the model's weights on the device(s)
    warmup_seconds: float  # compiling the step programs at start-up (0: no warm-up)
    max_logit_bias: int  # logit_bias entries a request may carry
    # What logprobs hold (`EngineConfig.logprobs_mode`): "raw_logprobs", "raw_logits",
    # "processed_logprobs" or "processed_logits".
    logprobs_mode: str = "raw_logprobs"
    # The mesh: devices one engine spans (tensor parallel), engine replicas side by
    # side (data parallel), all the devices and processes serving, and the KV pool's
    # bytes on each device.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    num_devices: int = 1
    num_processes: int = 1
    kv_cache_bytes_per_device: int = 0
    # The host KV tier's bytes (kv_offload_bytes): what pushed pages may fill; 0: none.
    kv_tier_bytes: int = 0
    # Whether the front exports and imports KV pages (the `export_prefix` and
    # `import_pages` controls), as disaggregated serving's prefill and decode roles
    # need: one engine's front can; a data-parallel or Ray replica's cannot (which
    # replica holds a prefix is the router's choice).
    can_transfer_kv: bool = True


@dataclasses.dataclass
class BeamSearchSequence:
    """One hypothesis of a beam search, as vLLM's (`LLM.beam_search`): `tokens` are the
    prompt's then the generated ones (an ending EOS included), `text` the generated
    text, `cum_logprob` the generated tokens' summed logprobs, and `logprobs` one
    {token: logprob} per generated token. `score` (a jaxserve addition) is what beams
    are ranked by: cum_logprob / generated_len ** length_penalty (transformers')."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0


@dataclasses.dataclass
class BeamSearchOutput:
    """A beam search's result for one prompt (vLLM's): the best sequences, best first."""

    sequences: list[BeamSearchSequence]
