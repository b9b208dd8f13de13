"""Incremental detokenization and stop strings (no JAX).

Text is decoded in a sliding window of tokens (vLLM's scheme): a token whose
bytes end inside a multibyte character decodes to U+FFFD, and is held back
until the character is complete, so a stream never carries broken UTF-8.

Stop strings are never streamed, not even in part: the last
`max(len(stop)) - 1` characters stay unreleased until more text proves they
do not begin a stop string, or the sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

# Prompt tokens decoded as context for the first outputs (leading spaces, merges).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # the output text so far (cut at a stop string)
        self.released = 0  # characters of `text` already streamed

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int, *, check_stop: bool = True) -> str | None:
        """Appends one output token; returns the stop string it completed, if any.

        With `check_stop=False` (before min_tokens is reached) stop strings are not
        looked for, as in vLLM: the text keeps everything, and a stop string that
        ends before min_tokens never ends the sequence.
        """
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        old = len(self.text)
        self.text += new
        if not check_stop:
            return None
        # Each stop string is looked for only where it could end in the new text, so
        # one that ended before (under min_tokens) is not found late.
        hits = [
            (at, stop)
            for stop in self.stop
            if (at := self.text.find(stop, max(0, old - len(stop) + 1))) != -1
        ]
        if not hits:
            return None
        at, stop = min(hits)  # the earliest stop string wins
        self.text = self.text[: at + len(stop) if self.include_stop else at]
        return stop

    def release(self, finished: bool) -> str:
        """The text that may be streamed now (all of it once the sequence has finished)."""
        end = len(self.text) if finished else max(self.released, len(self.text) - self.hold)
        delta = self.text[self.released : end]
        self.released = end
        return delta
