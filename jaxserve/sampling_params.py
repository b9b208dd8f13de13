"""Per-request sampling parameters, with vLLM's field names and validation.

Every invalid value raises `ParamError` (a ValueError) naming the field and the
value, before a request reaches the engine. The field's name is also data
(`ParamError.field`), for front ends that report it under their own names.

`SamplingParams`' fields are the one description of a request's sampling
settings: the gRPC, HTTP and CLI front ends map theirs onto them by name
(`FIELDS`), each with a short list of the fields it names or converts
otherwise, and their tests fail on a field a front end does not carry.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math

logger = logging.getLogger(__name__)

# The most top logprobs a request may ask for (vLLM's default cap).
MAX_LOGPROBS = 20
# The most outputs one request may ask for (the OpenAI API's bound on n).
MAX_N = 128
# The sampler computes in float32: every float setting must be finite there.
FLOAT32_MAX = 3.4028234663852886e38
# A positive temperature below this is raised to it (as vLLM does): logits divided
# by a smaller one overflow float32 to inf, and the softmax to NaN.
MIN_TEMPERATURE = 1e-2
SEED_RANGE = (-(2**63), 2**63)  # int64, as vLLM and the gRPC field


class ParamError(ValueError):
    """A refused request value. `field` names it as `SamplingParams` and
    `GenerateRequest` do ("temperature", "max_tokens", "prompt_token_ids",
    "structured_outputs", ...), or is None where no one field is at fault."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # keeps the field across processes (Ray replicas)
        return type(self), (self.field, str(self))


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output (vLLM's `StructuredOutputsParams`): exactly one of
    a JSON schema (dict or JSON text), any JSON object, a regex, a choice among
    strings, or a context-free grammar."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [
            f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)
        ]
        if len(given) != 1:
            raise ParamError(
                "structured_outputs",
                "structured_outputs must set exactly one of json, json_object, regex, "
                f"choice, grammar; got {given or 'none'}",
            )
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ParamError(
                    "structured_outputs",
                    f"structured_outputs.choice must be non-empty strings, got {self.choice!r}",
                )
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParamError(
                    "structured_outputs",
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}",
                )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ParamError(
                "structured_outputs",
                f"structured_outputs.json must be a JSON schema (dict or JSON text), "
                f"got {type(self.json).__name__}",
            )

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(f.name for f in dataclasses.fields(self) if getattr(self, f.name))


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request's steps make (vLLM's): every step's whole result so far
    (CUMULATIVE), every step's new tokens and text only (DELTA: a stream's), or one
    output when the request finishes (FINAL_ONLY: `LLM.generate`'s). The outputs of
    a step cost what they hold, so a front end asks for what it reads: CUMULATIVE
    copies each sample's tokens so far every step."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k; past the vocabulary: all of it (as 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # False: no text is made (vLLM's): outputs carry token ids only, and no detokenizer
    # runs for the request (stop strings, which match text, need one).
    detokenize: bool = True
    # Set by the front end (what it reads of the outputs), not by its clients: not
    # among the fields a front end carries (`FIELDS`).
    output_kind: RequestOutputKind = dataclasses.field(
        default=RequestOutputKind.CUMULATIVE, metadata={"front_end": True}
    )

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %r is below %r and raised to it (float32 logits would overflow)",
                self.temperature,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        def bad(field: str, why: str):
            raise ParamError(field, f"{field} {why}, got {getattr(self, field)!r}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def finite(field: str):
            value = getattr(self, field)
            if not isinstance(value, int | float) or not math.isfinite(value):
                bad(field, "must be a finite number")
            if abs(value) > FLOAT32_MAX:
                bad(field, f"must be finite in float32 (at most {FLOAT32_MAX:.4g} in magnitude)")

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        for f in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            finite(f)
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for f in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, f) <= 2:
                bad(f, "must be in [-2, 2]")
        if not self.repetition_penalty >= 1e-30:  # > 0, and not 0 in float32
            bad("repetition_penalty", "must be > 0 (at least 1e-30)")
        if self.seed is not None and (
            not is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            bad("seed", "must be a 64-bit signed integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        for f in ("logprobs", "prompt_logprobs"):
            value = getattr(self, f)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(f, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not isinstance(self.detokenize, bool):
            bad("detokenize", "must be a bool")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be a RequestOutputKind")
        if self.stop and not self.detokenize:
            raise ParamError(
                "stop",
                f"stop {self.stop!r}: stop strings match text, and detokenize=False makes "
                "none; use stop_token_ids, or detokenize=True",
            )
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            bad("structured_outputs", "must be a StructuredOutputsParams or None")
        for token, bias in (self.logit_bias or {}).items():
            if not is_int(token) or token < 0:
                raise ParamError(
                    "logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}"
                )
            if not isinstance(bias, int | float) or not -100 <= bias <= 100:
                raise ParamError(
                    "logit_bias", f"logit_bias[{token}] must be in [-100, 100], got {bias!r}"
                )


# The sampling settings every front end carries, by SamplingParams' names.
FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if not f.metadata.get("front_end")
)


# A beam search takes max(2, 1 + EOS ids) * beam_width candidates a step from each
# beam's top logprobs, of which the sampler computes MAX_LOGPROBS: with one EOS id,
# 10 beams at most (transformers' rule: see `jaxserve.beam_search`).
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """A beam search (vLLM's `BeamSearchParams`, `LLM.beam_search`): the `beam_width`
    best sequences of at most `max_tokens` tokens by cumulative logprob, finished ones
    ranked by `cum_logprob / num_tokens ** length_penalty` as transformers does
    (`jaxserve.beam_search`).

    `temperature` > 0 scores candidates by log_softmax(logits / temperature); 0 (the
    default) by the model's raw logprobs. `early_stopping` is transformers' (a
    jaxserve extension): False (its default) stops once no running beam can beat the
    worst of `beam_width` finished ones at its current length; True as soon as
    `beam_width` are finished; "never" only when none can at max_tokens (for a
    positive length_penalty). `ignore_eos`: EOS ends no beam. `include_stop_str_in_
    output` is accepted for vLLM's API (a beam search stops at EOS only).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self):
        def bad(field: str, why: str):
            raise ParamError(field, f"{field} {why}, got {getattr(self, field)!r}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            bad("beam_width", f"must be an integer in [1, {MAX_BEAM_WIDTH}]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                bad(name, "must be a number")
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                bad(name, "must be finite")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.early_stopping not in (True, False, "never") or (
            self.early_stopping in (0, 1) and not isinstance(self.early_stopping, bool)
        ):
            bad("early_stopping", 'must be True, False or "never"')
