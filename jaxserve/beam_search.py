"""Beam search's bookkeeping, as transformers' `generate(num_beams=k)` (host logic, no
JAX, no engine): a group's running beams and finished hypotheses, advanced one token
at a time from each beam's top candidates.

The rule, step by step (transformers 5's `_beam_search`: `_get_top_k_continuations`,
`_get_running_beams_for_next_iteration`, `_update_finished_beams`,
`_check_early_stop_heuristic`, `_beam_search_has_unfinished_sequences`):

- Every running beam offers its top tokens; a candidate's score is the beam's
  cumulative logprob plus the token's. The best K = max(2, 1 + #EOS ids) * k of all
  candidates are kept, best first (each beam's top K suffice: the sampler returns
  20, hence beam_width <= 10 with one EOS id). A candidate *ends* if its token is an
  EOS id (unless ignore_eos) or it reaches max_tokens.
- The next running beams are the best k candidates that do not end.
- Candidates that end and rank among the first k become finished hypotheses, scored
  `cum_logprob / generated_len ** length_penalty` (generated_len counts the EOS);
  the best k hypotheses are kept.
- The search is done when every candidate ends (max_tokens), or k hypotheses are
  finished and either `early_stopping` is True or the best running beam cannot beat
  the worst hypothesis: its cumulative logprob over its current length (over
  max_tokens with early_stopping "never" and a positive length_penalty) ** penalty.

The result is the finished hypotheses, best first. Beams are opaque handles here
(the engine's sequences): `step` says which parent each new beam continues.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from jaxserve.sampling_params import BeamSearchParams, SamplingParams


def sampling_params(beam: BeamSearchParams, base: SamplingParams | None = None) -> SamplingParams:
    """The sampling settings of a beam search's sequences: greedy rows (the token a row
    draws is not used: its top logprobs are the candidates) and the beam search's
    length; text settings (`skip_special_tokens`, `detokenize`) from `base`."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=beam.max_tokens,
        ignore_eos=beam.ignore_eos,
        include_stop_str_in_output=beam.include_stop_str_in_output,
        skip_special_tokens=True if base is None else base.skip_special_tokens,
        detokenize=True if base is None else base.detokenize,
    )


def beam_score(cum_logprob: float, num_tokens: int, length_penalty: float) -> float:
    """A finished hypothesis's score: cumulative logprob over its generated length
    (EOS included) to the length penalty, as transformers ranks them."""
    return cum_logprob / (num_tokens**length_penalty)


@dataclasses.dataclass
class Beam:
    """A running beam: its handle (the engine's sequence), generated tokens, their
    logprobs, and its cumulative logprob. `parent`: the handle it continues (`step`)."""

    handle: Hashable
    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float = 0.0
    parent: Hashable = None


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """A finished beam: generated tokens (an EOS included), their logprobs, cumulative
    logprob and score; why it ended ("stop": EOS, "length": max_tokens)."""

    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float
    finish_reason: str


class BeamGroup:
    """One prompt's beam search (`params`; `eos_token_ids` end a beam unless ignore_eos),
    starting from one running beam, `root`."""

    def __init__(self, params: BeamSearchParams, eos_token_ids, root: Hashable):
        self.params = params
        self.k = params.beam_width
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * self.k  # K, from all beams
        self.running: list[Beam] = [Beam(root, [], [])]
        self.finished: list[Hypothesis] = []  # the best k, best first
        self.candidates: dict[Hashable, tuple[Sequence[int], Sequence[float]]] = {}
        self.done = False

    @property
    def generated(self) -> int:
        """Tokens each running beam has generated (they advance together)."""
        return len(self.running[0].token_ids)

    def offer(self, handle: Hashable, token_ids: Sequence[int], logprobs: Sequence[float]) -> bool:
        """A running beam's top tokens and their logprobs, best first (at least K);
        returns whether every running beam has offered, so that `step` may run."""
        if len(token_ids) < self.num_candidates:
            raise ValueError(f"{len(token_ids)} candidates; a step needs {self.num_candidates}")
        self.candidates[handle] = (token_ids, logprobs)
        return all(b.handle in self.candidates for b in self.running)

    def step(self) -> list[Beam]:
        """Advances every beam one token from the candidates offered; returns the new
        running beams, best first, each naming the handle it continues (`parent`; its
        `handle` is that one's until the caller gives it its own)."""
        k, p = self.k, self.params
        length = self.generated + 1
        scored = []
        for b in self.running:
            ids, lps = self.candidates[b.handle]
            scored += [(b.cum_logprob + lp, b, t, lp) for t, lp in zip(ids, lps, strict=False)]
        # Stable: among equal scores the better-ranked beam, then its better token.
        scored.sort(key=lambda c: -c[0])
        top = scored[: self.num_candidates]
        ends = [t in self.eos or length >= p.max_tokens for _, _, t, _ in top]
        for rank, ((cum, b, t, lp), end) in enumerate(zip(top, ends, strict=True)):
            if end and rank < k:
                reason = "stop" if t in self.eos else "length"
                self._finish(b.token_ids + [t], b.logprobs + [lp], cum, reason)
        running = [
            Beam(b.handle, b.token_ids + [t], b.logprobs + [lp], cum, parent=b.handle)
            for (cum, b, t, lp), end in zip(top, ends, strict=True)
            if not end
        ][:k]
        self.candidates = {}
        self.done = all(ends) or not running or self._cannot_improve(running[0], length)
        self.running = [] if self.done else running
        return self.running

    def _finish(self, token_ids, logprobs, cum: float, reason: str) -> None:
        score = beam_score(cum, len(token_ids), self.params.length_penalty)
        if len(self.finished) == self.k and score <= self.finished[-1].score:
            return
        self.finished.append(Hypothesis(token_ids, logprobs, cum, score, reason))
        self.finished.sort(key=lambda h: -h.score)  # (stable: the earlier first on ties)
        del self.finished[self.k :]

    def _cannot_improve(self, best: Beam, length: int) -> bool:
        """transformers' stopping rule, once k hypotheses are finished."""
        p = self.params
        if len(self.finished) < self.k:
            return False
        if p.early_stopping is True:
            return True
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            length = p.max_tokens
        best_possible = best.cum_logprob / (length**p.length_penalty)
        return not best_possible > self.finished[-1].score


__all__ = ["Beam", "BeamGroup", "Hypothesis", "beam_score", "sampling_params"]
