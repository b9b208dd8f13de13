"""One request's failure, kept to that request: an unexpected exception in its host
work (building its sampler rows, applying its sampled tokens: logprobs, stop checks,
detokenizing, its grammar; proposing its drafts; building its output) ends it alone,
its pages freed, with an output naming the cause; the engine serves the others on.

The callers catch at the granularity of one request, never around a whole step, so
that the other requests of the step keep their tokens. A failure of the step itself
(the device step and what every request shares: the scheduler, the page pool) is
not one request's: it ends the engine (`LLMEngine.run`).

Host logic: no JAX.
"""

from __future__ import annotations

import logging

from jaxserve.outputs import RequestOutput
from jaxserve.request_state import RequestState
from jaxserve.scheduler import Scheduler
from jaxserve.sequence import Status

logger = logging.getLogger(__name__)


def fail_request(
    req: RequestState,
    error: BaseException,
    doing: str,
    scheduler: Scheduler,
    *,
    scheduled: bool = True,
) -> RequestOutput:
    """Ends `req` after `error` was raised while `doing` its work: logs the traceback,
    finishes its unfinished samples ("abort", their pages freed) and returns its last
    output, whose `error` names the cause. The caller forgets the request.
    `scheduled=False`: its samples were never handed to the scheduler (a request
    whose grammar was compiling)."""
    req.error = (
        f"request {req.request_id!r} failed on the engine while {doing}: "
        f"{type(error).__name__}: {error}"
    )
    logger.error("%s", req.error, exc_info=error)
    for seq in req.seqs:
        if scheduled:
            scheduler.finish(seq, "abort")  # (a finished sample stays as it is)
        elif not seq.finished:
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
    return req.output({})


__all__ = ["fail_request"]
