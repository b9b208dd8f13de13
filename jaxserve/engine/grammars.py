"""Structured output's admission: a request with a grammar waits here, off the
scheduler, until its grammar has compiled (in the compiler's pool), then is scheduled
with a matcher per sample; a failed compile finishes it ("abort").

Host logic: no JAX.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from jaxserve.engine.failures import fail_request
from jaxserve.engine_stats import EngineStats
from jaxserve.outputs import RequestOutput
from jaxserve.request_state import RequestState
from jaxserve.scheduler import Scheduler
from jaxserve.structured import GrammarCompiler
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class GrammarAdmission:
    """The requests waiting for their grammar (`waiting`), and the compiler, built at
    the first structured request. `forget` drops a request from the engine's table."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: set[int],
        scheduler: Scheduler,
        stats: EngineStats,
        forget: Callable[[str], RequestState | None],
    ):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.scheduler, self.stats, self.forget = scheduler, stats, forget
        self._grammars: GrammarCompiler | None = None  # built at the first structured request
        self.waiting: list[RequestState] = []  # waiting for their grammar, not yet scheduled

    def compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def close(self) -> None:
        """Stops the compiler's thread, if one was started, and drops the compiler (its
        tokenizer trie and compiled grammars)."""
        if self._grammars is not None:
            self._grammars.close()
            self._grammars = None

    def admit_compiled(self) -> list[RequestOutput]:
        """Schedules the requests whose grammar has compiled (a matcher per sample);
        finishes those whose compile failed ("abort"), returning their outputs."""
        failed = []
        for req in [r for r in self.waiting if r.grammar.done()]:
            self.waiting.remove(req)
            out = self._admit(req)
            if out is not None:
                failed.append(out)
                self.forget(req.request_id)
                self.stats.on_finish(aborted=True)
        return failed

    def _admit(self, req: RequestState) -> RequestOutput | None:
        """Schedules a request whose grammar has compiled; its final output instead if
        the compile failed, or its matchers raise (it fails alone)."""
        error = req.grammar.exception()
        if error is not None:
            return fail_request(
                req, error, "compiling its grammar", self.scheduler, scheduled=False
            )
        try:
            compiled = req.grammar.result()
            req.matchers = [self.compiler().matcher(compiled) for _ in req.seqs]
        except Exception as e:
            return fail_request(req, e, "starting its grammar", self.scheduler, scheduled=False)
        for seq in req.seqs:
            self.scheduler.add(seq)
        return None

    def wait(self) -> None:
        """With nothing to run but requests whose grammar compiles, waits a little for
        one (instead of spinning on the cores the compile needs)."""
        if self.waiting:
            concurrent.futures.wait(
                [r.grammar for r in self.waiting],
                timeout=0.05,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )


__all__ = ["GrammarAdmission"]
