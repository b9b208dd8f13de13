"""The grammar compiler of an engine, its cache, and the per-sequence matcher.

`GrammarCompiler` is built once per engine from its tokenizer. Each distinct spec
compiles once, on a small thread pool (never the engine thread), into a template
matcher kept in a bounded LRU cache; every sequence constrained by that spec
(each of a request's n samples) gets its own copy, a `GrammarMatcher`, which
fills its row of the step's allowed-token bitmask and follows the sampled tokens.

The bitmask layout is the sampler's (`SamplingMetadata.allowed`): bit v % 32 of
word v // 32 set = token v allowed; llguidance writes it straight into the row
(as int32 words, the same bits).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Iterable

import llguidance
import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured.grammar import llg_tokenizer, spec_key, to_grammar
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class GrammarMatcher:
    """One sequence's grammar state: which tokens may come next, and where it stands."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, num_tokens: int):
        self._m = matcher
        # Ids past the tokenizer's vocabulary (the model's padding) are blocked: the
        # words from the first such id on are AND-ed with this.
        first = min(num_tokens, vocab_size)
        self._pad_from = first // 32
        words = -(-vocab_size // 32) - self._pad_from
        ids = np.arange(self._pad_from * 32, (self._pad_from + words) * 32)
        self._pad_words = np.packbits(ids < first, bitorder="little").view(np.uint32)

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row` ([ceil(V/32)] uint32, contiguous)."""
        if row.dtype != np.uint32 or not row.flags.c_contiguous:
            raise ValueError(f"bitmask row must be contiguous uint32, got {row.dtype}")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        row[self._pad_from :] &= self._pad_words

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar does not allow it (the
        matcher is then in an error state)."""
        return self._m.consume_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def rollback(self, num_tokens: int) -> bool:
        """Undoes the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        return self._m.rollback(num_tokens)


class GrammarCompiler:
    """Compiles structured-output specs for one engine's tokenizer and vocabulary."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        cache_size: int = 128,
        max_workers: int = 1,
    ):
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        self._num_tokens = tokenizer.vocab_size
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # `check` runs on front-end threads too
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="jaxserve-grammar"
        )
        # The tokenizer's trie takes ~1 s for a 150k vocabulary: built in the
        # background from the start, the first compile waits for it.
        self._tokenizer = self._pool.submit(
            llg_tokenizer, tokenizer, vocab_size, list(eos_token_ids)
        )
        self.num_compiled = 0  # specs compiled (cache misses)

    @staticmethod
    def check(spec: StructuredOutputsParams) -> None:
        """Raises ValueError naming the field if `spec` is not a valid grammar (about
        a millisecond, without the tokenizer: callable from any thread)."""
        to_grammar(spec)

    def compile(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """The spec's compiled template (a Future, done at once on a cache hit); a
        failed compile's Future raises ValueError naming the field (only ValueError:
        the engine hands it to the request's caller)."""
        key = spec_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # waiting requests hold their Future
            return future

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = to_grammar(spec)
        try:
            tokenizer = self._tokenizer.result()
        except Exception as e:  # e.g. a tokenizer with more tokens than the model has ids
            raise ValueError(
                f"structured_outputs.{spec.kind}: this model's tokenizer cannot drive a "
                f"grammar: {e}"
            ) from e
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        except Exception as e:  # documented never to raise; a caller gets a ValueError
            raise ValueError(f"structured_outputs.{spec.kind} failed to compile: {e}") from e
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled: llguidance.LLMatcher) -> GrammarMatcher:
        """A fresh matcher for one sequence, from a compiled template."""
        return GrammarMatcher(compiled.deep_copy(), self.vocab_size, self._num_tokens)

    def close(self) -> None:
        """Stops the compile thread: queued compiles are cancelled, a running one is
        waited for (its thread ends with it)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
