"""Beam search in the engine: a request's beams are ordinary sequences of the
continuous batch, and its `BeamGroup` (`jaxserve.beam_search`) decides, once every
running beam has its next token's candidates, which beams go on with which token.

A beam's step samples no token: its sampler row (a greedy row marked `beam`, so the
sampler returns log_softmax(logits / temperature)'s top 20 in any logprobs mode)
gives its candidates, which wait in the group until all its beams have theirs (a
beam preempted or left out of a step catches up in a later one; the others wait,
taking no step). The group then appends each surviving beam's token to its parent
sequence, forks a parent that several survivors continue (`Scheduler.fork`: the
new sequence shares the parent's pages, copy-on-write) and finishes the parents
none continues. Once done, the request's one output carries the best hypotheses.

Beam searches run with synchronous steps (`RequestState.sync_only`): the next
tokens are chosen on the host from the step's candidates.

Host logic: no JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from jaxserve import beam_search
from jaxserve.beam_search import BeamGroup, Hypothesis
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.generate_request import GenerateRequest
from jaxserve.outputs import CompletionOutput
from jaxserve.sampling_params import BeamSearchParams
from jaxserve.scheduler import ScheduledSeq, Scheduler
from jaxserve.sequence import SequenceState
from jaxserve.tokenizer import Tokenizer


def as_sequences(request: GenerateRequest) -> GenerateRequest:
    """A beam search request as its sequences run: one sample, greedy rows
    (`beam_search.sampling_params`), to be `attach`ed once its state exists."""
    return dataclasses.replace(
        request, params=beam_search.sampling_params(request.beam, request.params)
    )


def attach(
    req,
    beam: BeamSearchParams,
    num_outputs: int,
    eos_token_ids: set[int],
    tokenizer: Tokenizer | None,
) -> None:
    """Makes `req` (the `RequestState` of an `as_sequences` request, its one sequence
    the root beam) the beam search `beam`, whose `num_outputs` best hypotheses (the
    request's n) are its result: its group, and the running slots it holds."""
    root = req.seqs[0]
    root.seats = beam.beam_width
    params, ids = req.params, req.prompt_token_ids

    def detokenizer() -> IncrementalDetokenizer | None:
        if tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(tokenizer, ids, params)

    req.beam = BeamState(BeamGroup(beam, eos_token_ids, root), root, detokenizer, num_outputs)


@dataclasses.dataclass(eq=False)
class BeamState:
    """A beam search request's group, and how its finished hypotheses get text
    (`detokenizer()`: a fresh detokenizer after the prompt, or None for ids only)."""

    group: BeamGroup
    root: SequenceState  # the first beam (its prefix-cache hit is the request's)
    detokenizer: Callable[[], IncrementalDetokenizer | None]
    num_outputs: int  # the best hypotheses returned
    indices: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1))

    @property
    def temperature(self) -> float:
        """The sampler row's `beam` value: the candidates' temperature (1: raw logprobs)."""
        return self.group.params.temperature or 1.0

    def offer(self, item: ScheduledSeq, out, row: int) -> bool:
        """A beam's candidates from the step's sampler row `row`; returns whether every
        beam has offered (then `advance`, once the step's rows are all applied). A row
        for tokens the beam no longer ends with (a recomputation that the group
        overtook) is stale: ignored."""
        seq = item.seq
        if item.start + item.num_tokens != seq.num_tokens or not any(
            b.handle is seq for b in self.group.running
        ):
            return False
        k = self.group.num_candidates
        return self.group.offer(
            seq, out.top_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist()
        )

    def advance(self, req, scheduler: Scheduler) -> None:
        """One group step applied to the sequences: forks first (a child copies its
        parent's tokens), then each parent's own token; parents none continues end."""
        parents: list[SequenceState] = [b.handle for b in self.group.running]
        beams = self.group.step()
        continued: set[SequenceState] = set()
        for beam in beams:
            parent = beam.parent
            if parent in continued:
                beam.handle = scheduler.fork(parent, next(self.indices))
            else:
                continued.add(parent)
        for beam in beams:
            beam.handle.append(beam.token_ids[-1])
        for seq in parents:  # (all of them once the group is done: it returns no beams)
            if seq not in continued:
                scheduler.finish(seq, "stop")
        req.seqs = [b.handle for b in beams]

    def completions(self) -> list[CompletionOutput]:
        """The best `num_outputs` finished hypotheses, best first: the request's outputs."""
        best = self.group.finished[: self.num_outputs]
        return [self._completion(i, h) for i, h in enumerate(best)]

    def _completion(self, index: int, h: Hypothesis) -> CompletionOutput:
        detok = self.detokenizer()
        text = ""
        if detok is not None:
            for token in h.token_ids:
                detok.add(token, check_stop=False)
            text = detok.text
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(h.token_ids),
            cumulative_logprob=h.cum_logprob,
            logprobs=[{t: lp} for t, lp in zip(h.token_ids, h.logprobs, strict=True)],
            finish_reason=h.finish_reason,
            stop_reason=h.token_ids[-1] if h.finish_reason == "stop" else None,
            delta_text=text,
            delta_token_ids=list(h.token_ids),
        )


__all__ = ["BeamState", "as_sequences", "attach"]
