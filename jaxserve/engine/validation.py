"""Request validation: a request checked against an engine's model, limits and pool,
before anything is queued (or, by a front of remote replicas, sent).

Host logic: no JAX, so a front checks requests without loading the device side.
"""

from __future__ import annotations

from jaxserve import beam_search
from jaxserve.config import EngineConfig
from jaxserve.generate_request import GenerateRequest
from jaxserve.lora import LoRARequest
from jaxserve.request_state import check_resume
from jaxserve.sampling_params import MAX_LOGPROBS, BeamSearchParams, ParamError, SamplingParams
from jaxserve.structured import GrammarCompiler


def validate_request(
    config: EngineConfig, pool_capacity: int, has_tokenizer: bool, request: GenerateRequest
) -> int:
    """Checks a request against an engine's model, limits and pool of `pool_capacity`
    pages (`LLMEngine.validate`; a front of remote replicas checks here, before
    anything is sent); returns its max_tokens.

    Raises ParamError naming the field and the value.
    """
    if not isinstance(request.priority, int) or isinstance(request.priority, bool):
        raise ParamError("priority", f"priority must be an integer, got {request.priority!r}")
    _validate_lora(config, request.lora)
    if request.beam is not None:
        _validate_beam(config, request)
        params = beam_search.sampling_params(request.beam, request.params)
        max_tokens = _validate_prompt(config, pool_capacity, request.prompt_token_ids, params)
        _validate_beam_pages(config, pool_capacity, len(request.prompt_token_ids), request.beam)
        return max_tokens
    max_tokens = _validate_prompt(config, pool_capacity, request.prompt_token_ids, request.params)
    _validate_params(config, has_tokenizer, request.params)
    if request.resume is not None:
        try:
            check_resume(request.resume, request.params, max_tokens, config.model.vocab_size)
        except ValueError as e:
            raise ParamError("resume", str(e)) from None
    return max_tokens


def _validate_lora(config: EngineConfig, lora) -> None:
    """The request's adapter, as far as it can be checked without reading it (the
    engine reads and checks its files when the request is added)."""
    if lora is None:
        return
    if not isinstance(lora, LoRARequest):
        raise ParamError("lora", f"lora must be a LoRARequest or None, got {lora!r}")
    if not config.lora.enable_lora:
        raise ParamError(
            "lora",
            f"lora {lora.lora_name!r}: this engine serves no LoRA adapters (start it with "
            "enable_lora=True)",
        )


def _validate_prompt(
    config: EngineConfig, pool_capacity: int, ids: tuple[int, ...], params: SamplingParams
) -> int:
    """The prompt's ids and length, and the room it needs; returns its max_tokens."""
    vocab = config.model.vocab_size
    if not ids:
        raise ParamError("prompt_token_ids", "prompt_token_ids must not be empty")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ParamError(
            "prompt_token_ids",
            f"prompt_token_ids has ids outside the vocabulary [0, {vocab}): {bad[:5]}",
        )
    limit = config.max_model_len
    if len(ids) >= limit:
        raise ParamError(
            "prompt_token_ids",
            f"prompt has {len(ids)} tokens; max_model_len is {limit}, "
            "which must leave room for at least one generated token",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
    if len(ids) + max_tokens > limit:
        raise ParamError(
            "max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
            f"max_model_len ({limit})",
        )
    need = -(-(len(ids) + max_tokens) // config.cache.page_size)
    if need > pool_capacity:
        raise ParamError(
            "max_tokens",
            f"request needs {need} KV pages for {len(ids) + max_tokens} tokens; "
            f"the whole pool has {pool_capacity}",
        )
    return max_tokens


# Sampling settings a beam search cannot honour, with their neutral values: its
# candidates are the model's top logprobs (tempered by the beam search's own
# temperature), and only EOS or its length end a beam.
_NOT_WITH_BEAM = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": [],
    "stop_token_ids": [],
    "min_tokens": 0,
    "prompt_logprobs": None,
    "logit_bias": None,
    "structured_outputs": None,
}


def _validate_beam(config: EngineConfig, request: GenerateRequest) -> None:
    """A beam search against the engine and its request's other settings."""
    beam, params = request.beam, request.params
    if not isinstance(beam, BeamSearchParams):
        raise ParamError("beam", f"beam must be a BeamSearchParams, got {type(beam).__name__}")
    eos = () if beam.ignore_eos else config.model.eos_token_ids or (None,)
    per_beam = max(2, 1 + len(eos)) * beam.beam_width
    if per_beam > MAX_LOGPROBS:
        raise ParamError(
            "beam_width",
            f"beam_width {beam.beam_width}: each step takes the best {per_beam} candidates "
            f"(max(2, 1 + {len(eos)} EOS ids) x beam_width) from each beam's top "
            f"{MAX_LOGPROBS} logprobs; at most {MAX_LOGPROBS // max(2, 1 + len(eos))} here",
        )
    if beam.beam_width > config.scheduler.max_num_seqs:
        raise ParamError(
            "beam_width",
            f"beam_width {beam.beam_width}: the beams run side by side, and this engine "
            f"runs at most max_num_seqs={config.scheduler.max_num_seqs} sequences",
        )
    if config.hybrid_kv:
        raise ParamError(
            "beam",
            f"beam search with a hybrid KV cache: {config.model_dir!r} has sliding-window "
            "layers, whose pages the beams cannot share yet; serve it with "
            "disable_hybrid_kv_cache_manager=True for beam search",
        )
    if request.lora is not None:
        raise ParamError(
            "lora",
            f"beam search with the LoRA adapter {request.lora.lora_name!r}: its beams "
            "would leave the adapter's slot behind (not supported yet)",
        )
    if config.speculative is not None:
        raise ParamError(
            "beam",
            "beam search with speculative decoding: this engine speculates "
            f"({config.speculative.method}); a beam's next tokens are chosen among every "
            "beam's candidates, which drafts cannot verify",
        )
    if request.resume is not None:
        raise ParamError("resume", "resume: a beam search cannot be resumed")
    for field, neutral in _NOT_WITH_BEAM.items():
        if getattr(params, field) != neutral:
            raise ParamError(
                field,
                f"{field} {getattr(params, field)!r} cannot be used with beam search "
                "(its beams are ranked by the model's logprobs and end at EOS or max_tokens)",
            )
    if params.n > beam.beam_width:
        raise ParamError(
            "n", f"n ({params.n}) must be <= beam_width ({beam.beam_width}) with beam search"
        )


def _validate_beam_pages(config: EngineConfig, capacity: int, prompt: int, beam) -> None:
    """A beam search must fit the pool alone: the prompt's pages once (the beams share
    them) and each beam's own pages past them, as the beams may all diverge at once."""
    page = config.cache.page_size
    shared = (prompt - 1) // page
    need = shared + beam.beam_width * (-(-(prompt + beam.max_tokens) // page) - shared)
    if need > capacity:
        raise ParamError(
            "beam_width",
            f"beam_width {beam.beam_width}: a beam search over {prompt} prompt tokens with "
            f"max_tokens {beam.max_tokens} may hold {need} KV pages; the whole pool has "
            f"{capacity}",
        )


def _validate_params(config: EngineConfig, has_tokenizer: bool, params: SamplingParams) -> None:
    """What SamplingParams cannot check alone: the engine's limits, tokenizer and vocab."""
    vocab = config.model.vocab_size
    if len(params.logit_bias or {}) > config.max_logit_bias:
        raise ParamError(
            "logit_bias",
            f"logit_bias has {len(params.logit_bias)} entries; this engine takes at "
            f"most {config.max_logit_bias} (its max_logit_bias)",
        )
    if params.stop and not has_tokenizer:
        raise ParamError(
            "stop",
            f"stop {params.stop!r}: stop strings need a tokenizer, and this engine has "
            "none (skip_tokenizer_init); use stop_token_ids",
        )
    if params.structured_outputs is not None:
        if not has_tokenizer:
            raise ParamError(
                "structured_outputs",
                f"structured_outputs.{params.structured_outputs.kind}: structured output "
                "needs a tokenizer, and this engine has none (skip_tokenizer_init)",
            )
        try:
            GrammarCompiler.check(params.structured_outputs)  # ~1 ms; the compile is later
        except ValueError as e:
            raise ParamError("structured_outputs", str(e)) from None
    if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
        raise ParamError(
            "stop_token_ids",
            f"stop_token_ids names token {max(params.stop_token_ids)}, outside the "
            f"vocabulary [0, {vocab})",
        )
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise ParamError(
            "logit_bias",
            f"logit_bias names token {max(params.logit_bias)}, outside the vocabulary [0, {vocab})",
        )


__all__ = ["validate_request"]
