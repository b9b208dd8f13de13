"""The host-side state of one sequence (a request, or one of its n samples)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable

from jaxserve.lora import adapter_salt
from jaxserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class SequenceState:
    """One stream of tokens: its prompt, outputs, pages and progress.

    A request with n > 1 has n sequences; siblings after the first wait until
    the first has computed the prompt, then reuse its cached pages.
    """

    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: int  # admission order: FCFS ties and "newest" for preemption
    priority: int = 0  # lower runs first (vLLM's convention)
    salt: Hashable = None  # cache_salt (and adapter): never share prefix-cache pages
    seed: int = 0  # the sampling key's seed; fixed at arrival
    leader: SequenceState | None = None  # for n > 1 siblings
    prompt: str | None = None
    lora_key: str | None = None  # its LoRA adapter's content key (`jaxserve.lora.Adapter`)
    # Running slots (of max_num_seqs) its request holds once it runs: a beam search's
    # sequences hold the beam width between them; every other sequence one.
    seats: int = 1

    status: Status = Status.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    # A hybrid KV cache's other layer groups' tables (`jaxserve.kv.groups`), as long as
    # `pages`; a windowed group's entries are the null page (0) once out of its window.
    group_pages: list[list[int]] = dataclasses.field(default_factory=list)
    page_uids: list[int] = dataclasses.field(default_factory=list)  # of cached full pages
    page_digests: list[bytes] = dataclasses.field(default_factory=list)  # their digests
    num_computed: int = 0  # tokens whose K/V are in the cache
    # Asynchronous scheduling: tokens a dispatched step samples for this sequence that
    # are not back on the host yet (they follow token_ids; a next step may compute them).
    num_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    lora_slot: int = 0  # while running: the device slot of its adapter (0: none)
    # Speculative decoding: tokens proposed to follow token_ids, verified next step.
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    draft_computed: int = 0  # the draft model's tokens whose K/V are in the pages
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)  # prompt + outputs, appended in place

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)

    def fork(self, index: int, pages: list[int], page_size: int) -> SequenceState:
        """A new sequence with this one's tokens so far (a beam of a beam search) and
        `pages`, the pool's fork of the pages holding its computed tokens (shared by
        reference, copy-on-write): it goes on from the same computed state."""
        if self.num_placeholders or self.spec_token_ids:
            raise RuntimeError("a sequence with tokens in flight or drafts cannot fork")
        child = dataclasses.replace(self, index=index, output_ids=list(self.output_ids))
        child.token_ids, child.spec_token_ids = list(self.token_ids), []
        child.pages = list(pages)
        child.page_uids, child.page_digests = list(self.page_uids), list(self.page_digests)
        # The draft model's K/V of the partial last page is not copied: recomputed.
        child.draft_computed = min(self.draft_computed, self.num_computed // page_size * page_size)
        return child

    def sort_key(self) -> tuple[int, int]:
        """Who goes first: lower priority value, then earlier arrival."""
        return (self.priority, self.arrival)


def samples_of(request, ids: list[int], max_tokens: int, indices, arrival: int, rng, lora_key=None):
    """A new request's samples (`GenerateRequest` `request`, those of `indices`), each
    with its own seed (from `rng` where the request sets none); `arrival` orders it.
    `lora_key`: its adapter's content key (None: the base model)."""
    params = request.params
    seqs: list[SequenceState] = []
    leader = None
    for i in indices:
        base = params.seed if params.seed is not None else rng.getrandbits(32)
        seq = SequenceState(
            request_id=request.request_id,
            index=i,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            arrival=arrival,
            priority=request.priority,
            salt=adapter_salt(request.cache_salt, lora_key),
            seed=(base + 7919 * i) & 0xFFFFFFFF,
            leader=leader,
            prompt=request.prompt,
            lora_key=lora_key,
        )
        leader = leader or seq
        seqs.append(seq)
    return seqs
