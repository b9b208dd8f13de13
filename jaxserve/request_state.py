"""A request's host-side state in the engine, and what is done with it after a step:
record logprobs, check stop conditions, detokenize and build its `RequestOutput`.

One `RequestState` per request (its `n` samples are `SequenceState`s of the scheduler);
the engine owns the map of them and calls these methods with each step's
results. Nothing here touches the device or the scheduler.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import TYPE_CHECKING

from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.generate_request import ResumedSample
from jaxserve.lora import LoRARequest
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.sequence import SequenceState
from jaxserve.structured import GrammarMatcher

if TYPE_CHECKING:
    from jaxserve.engine.beams import BeamState


@dataclasses.dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    detoks: list[IncrementalDetokenizer | None]
    logprobs: list[list[dict[int, Logprob]]]
    cumulative_logprob: list[float]
    arrival_time: float
    first_token_time: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] = dataclasses.field(
        default_factory=lambda: [None]  # the first prompt token has no prediction
    )
    grammar: concurrent.futures.Future | None = None  # structured output: its compile
    matchers: list[GrammarMatcher] | None = None  # one per sample, once compiled
    # Its steps need the previous step's tokens on the host (asynchronous scheduling
    # runs synchronous steps while such a request is live).
    sync_only: bool = False
    # Disaggregated decode: resumed samples' tokens, sent with their first output.
    resumed: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # Why the engine failed it (`jaxserve.engine.failures`): its outputs carry it.
    error: str | None = None
    # The weights' version that sampled its newest tokens (until it has any: the one
    # it arrived under), and the one that sampled its first output token.
    weight_version: int = 0
    first_weight_version: int | None = None
    lora: LoRARequest | None = None  # its adapter, if any
    # A beam search: its group (`seqs` are its running beams, changing each step).
    beam: BeamState | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.group.done or (bool(self.seqs) and all(s.finished for s in self.seqs))
        if len(self.seqs) == 1:  # (read for every request every step: n = 1 at once)
            return self.seqs[0].finished
        return all(s.finished for s in self.seqs)

    def resume(self, resume: tuple[ResumedSample, ...]) -> None:
        """Gives resumed samples their tokens so far, as if this engine had sampled them."""
        by_index = {r.index: r for r in resume}
        for seq in self.seqs:
            r = by_index[seq.index]
            detok = self.detoks[seq.index]
            for j, token in enumerate(r.token_ids):
                seq.append(token)
                if detok is not None:
                    detok.add(token, check_stop=False)  # the other instance checked them
                if self.params.logprobs is not None:
                    tokenizer = self.tokenizer(seq)
                    entry = {
                        t: Logprob.of(v, getattr(v, "rank", None), tokenizer, t)
                        for t, v in r.logprobs[j].items()
                    }
                    self.logprobs[seq.index].append(entry)
                    self.cumulative_logprob[seq.index] += r.logprobs[j][token]
            self.resumed[seq.index] = list(r.token_ids)

    def record_prompt_logprobs(self, item, offset: int, prompt_lp) -> None:
        """The prompt logprobs of a scheduled chunk (`item`) of the first sample, from
        the step's rows starting at `offset`."""
        seq = item.seq
        if seq.params.prompt_logprobs is None or seq.index != 0:
            return
        chosen, ranks, top_ids, top_lp = prompt_lp
        k = seq.params.prompt_logprobs
        tokenizer = self.tokenizer(seq)
        # Entry i is for prompt token i, predicted at position i - 1; a recomputation
        # after preemption finds its entries already there.
        for pos in range(item.start, min(item.start + item.num_tokens, seq.num_prompt_tokens - 1)):
            if len(self.prompt_logprobs) != pos + 1:
                continue
            row = offset + pos - item.start
            target = seq.prompt_token_ids[pos + 1]
            self.prompt_logprobs.append(
                _entry(
                    top_ids[row, :k], top_lp[row, :k], target, chosen[row], ranks[row], tokenizer
                )
            )

    def record_logprobs(self, seq: SequenceState, out, i: int, token: int) -> None:
        """The logprobs of `token`, sampled in the step's row `i`."""
        k = seq.params.logprobs
        entry = _entry(
            out.top_ids[i, :k],
            out.top_logprobs[i, :k],
            token,
            out.logprobs[i],
            out.ranks[i],
            self.tokenizer(seq),
        )
        self.logprobs[seq.index].append(entry)
        self.cumulative_logprob[seq.index] += entry[token]

    def tokenizer(self, seq: SequenceState):
        """The tokenizer that decodes the sample's logprobs' tokens (None: none)."""
        detok = self.detoks[seq.index]
        return None if detok is None else detok.tokenizer

    def check_stop(
        self, seq: SequenceState, token: int, eos_token_ids: set[int], max_model_len: int
    ) -> str | None:
        """Detokenizes the sample's new token; its finish reason if it stops there."""
        p = seq.params
        if len(seq.output_ids) >= p.min_tokens:
            if not p.ignore_eos and token in eos_token_ids:
                seq.stop_reason = token
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        detok = self.detoks[seq.index]
        if detok is not None:
            # As vLLM: stop strings are not looked for before min_tokens is reached.
            stop = detok.add(token, check_stop=len(seq.output_ids) >= p.min_tokens)
            if stop is not None:
                seq.stop_reason = stop
                return "stop"
        if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= max_model_len:
            return "length"
        return None

    def output(
        self, new_tokens: dict[SequenceState, list[int]], weight_version: int | None = None
    ) -> RequestOutput:
        """The request's output after a step: every sample so far, and its delta.
        `weight_version`: the version of the weights that sampled `new_tokens`."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if weight_version is not None:
            for seq in self.seqs:  # (a loop, not any(): this runs per request per step)
                if new_tokens.get(seq):
                    self.weight_version = weight_version
                    if self.first_weight_version is None:
                        self.first_weight_version = weight_version
                    break
        completions = []
        if self.beam is not None:  # one output, once done: the best hypotheses
            completions = self.beam.completions() if self.beam.group.done else []
        # DELTA: what is new only (a stream's), without copying what came before.
        delta_only = self.params.output_kind == RequestOutputKind.DELTA
        for seq in self.seqs if self.beam is None else ():
            detok = self.detoks[seq.index]
            text = delta = ""
            if detok is not None:
                if self.error is None:  # (a failed request's detokenizer may be what failed)
                    delta = detok.release(seq.finished)
                text = delta if delta_only else detok.text[: detok.released]
            tokens = new_tokens.get(seq, [])
            if self.resumed and seq in new_tokens:
                tokens = self.resumed.pop(seq.index, []) + tokens
            logprobs = None
            if seq.params.logprobs is not None:
                entries = self.logprobs[seq.index]
                logprobs = entries[len(entries) - len(tokens) :] if delta_only else list(entries)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(tokens) if delta_only else list(seq.output_ids),
                    cumulative_logprob=(
                        self.cumulative_logprob[seq.index] if logprobs is not None else None
                    ),
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=delta,
                    delta_token_ids=list(tokens),
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=(self.beam.root if self.beam else self.seqs[0]).num_cached_tokens,
            prompt_logprobs=(
                list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None
            ),
            error=self.error,
            weight_version=self.weight_version,
            first_weight_version=(
                self.weight_version
                if self.first_weight_version is None
                else self.first_weight_version
            ),
        )


def check_resume(
    resume: tuple[ResumedSample, ...], params: SamplingParams, max_tokens: int, vocab_size: int
) -> None:
    """Raises ValueError naming the field if the resumed samples are bad."""
    indices = [r.index for r in resume]
    if not resume or len(set(indices)) != len(indices) or not set(indices) <= set(range(params.n)):
        raise ValueError(
            f"resume.samples must name distinct samples of n={params.n}, got {indices}"
        )
    if params.structured_outputs is not None:
        raise ValueError("resume: structured output cannot be resumed (its grammar state)")
    for r in resume:
        if not r.token_ids or not all(0 <= t < vocab_size for t in r.token_ids):
            raise ValueError(
                f"resume.samples[{r.index}].token_ids must be ids in [0, {vocab_size}), "
                f"got {r.token_ids[:5]}"
            )
        if len(r.token_ids) >= max_tokens:
            raise ValueError(
                f"resume.samples[{r.index}] has {len(r.token_ids)} tokens; max_tokens "
                f"is {max_tokens}: nothing is left to generate"
            )
        if params.logprobs is not None and len(r.logprobs or ()) != len(r.token_ids):
            raise ValueError(f"resume.samples[{r.index}].logprobs must have one entry per token")


def _entry(top_ids, top_values, token: int, value, rank, tokenizer) -> dict[int, Logprob]:
    """One position's logprobs: the top k (ranks 1..k) and the token's own."""
    entry = {
        t: Logprob.of(v, r, tokenizer, t)
        for r, (t, v) in enumerate(zip(top_ids.tolist(), top_values.tolist(), strict=True), 1)
    }
    entry[token] = Logprob.of(float(value), int(rank), tokenizer, token)
    return entry
