"""The token-budget scheduler: decides each step's work; touches no device.

Each step has a budget of `max_num_batched_tokens` tokens and at most
`max_num_seqs` sequences. Running sequences go first (a decode token, or the
next chunk of a prompt: chunked prefill keeps decodes flowing), then waiting
sequences are admitted, each starting after its longest cached prefix. When a
running sequence needs a page and none is left, the lowest-priority, newest
running sequence is preempted: its pages are released (its full pages stay in
the prefix cache) and it is recomputed later.

A hybrid KV cache (`kv`: sliding-window layers in groups of their own pages,
`jaxserve.kv.groups`) changes only where pages come from: a sequence is admitted,
and grows, only if every group has its pages; a preempted or finished one gives
back every group's; a windowed group's pages go back once out of the window.

Speculative decoding: a decoding sequence with proposed tokens
(`SequenceState.spec_token_ids`) takes them as extra query tokens, from the budget
and the pages left once every running sequence has its real tokens, unless more
than `spec_max_batch` sequences are running (a compute-bound step, where
verifying costs more than it saves). Nobody is preempted for a draft. After the
step, `on_computed` keeps only the accepted drafts' KV: `num_computed` stops at
the first rejection and pages past the sequence's tokens go back to the pool, so
an unverified token is never cached.

With a host/disk tier (`tier`), a waiting sequence's lookup goes on past the
device's cached pages into the tier: the pages found there (read and checked
now) get fresh device pages, are cached under their names at once, and are
listed in the plan's `loads` for the engine to copy in before the step; the
sequence starts after them, as after any cached prefix.

Asynchronous scheduling: the engine plans a step while the one before is still
on the device. Each sequence that step samples for has a placeholder
(`SequenceState.num_placeholders`): the plan computes it as the sequence's next token
(the runner reads its id on the device), except for a sequence whose placeholder
is its last allowed token (max_tokens), which waits for the step in flight to
finish it. A page is cached once its tokens are all back on the host.

Copy-on-write (`kv.page_pool`): sequences may share pages. An n > 1 sample whose first
sample runs with all of the prompt but its last token computed is admitted by forking
those pages (one prefill, then n owners), and a beam search forks a beam into several
(`fork`). Whenever a sequence is given pages for the tokens it computes next, any page
it would write that has other owners is exchanged for its own copy first; the copies
leave in the plan's `copies` and run on the device before the step. A beam search's
sequences hold their group's beam width of the `max_num_seqs` running slots (`seats`).
"""

from __future__ import annotations

import bisect
import dataclasses
import random

from jaxserve.config import SchedulerConfig
from jaxserve.kv import sharing
from jaxserve.kv.groups import KVGroups
from jaxserve.kv.page_pool import ROOT_UID, PagePool
from jaxserve.kv.tier import KVTier
from jaxserve.kv.transfer import ROOT_DIGEST, Page, page_digest
from jaxserve.lora import SlotTable
from jaxserve.sequence import SequenceState, Status


# (slots, not frozen: built for every sequence every step; see input_batch.SeqWork)
@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    seq: SequenceState
    start: int  # first token to compute (== seq.num_computed when scheduled)
    num_tokens: int  # drafts included
    draft: tuple[int, ...] = ()  # proposed tokens verified after the real ones

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the tokens, so its logits predict (read
        when the step is planned: the sequence's tokens change once it has run)."""
        seq = self.seq
        return (
            self.start + self.num_tokens - len(self.draft) == seq.num_tokens + seq.num_placeholders
        )

    @property
    def placeholder(self) -> bool:
        """Whether the chunk's last token is one the previous step samples (asynchronous
        scheduling): unknown on the host, the step reads it on the device."""
        return self.start + self.num_tokens - len(self.draft) > self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens to compute: known ones (0 standing in for a placeholder), then the
        drafts."""
        ids, start = self.seq.token_ids, self.start
        if self.num_tokens == 1 and not self.draft:  # (a decode's: most items of a step)
            return [ids[start]] if start < len(ids) else [0]
        real = self.num_tokens - len(self.draft)
        known = ids[start : start + real]
        return known + [0] * (real - len(known)) + list(self.draft)


@dataclasses.dataclass
class SchedulerOutput:
    """The plan for one step."""

    scheduled: list[ScheduledSeq]
    preempted: list[SequenceState]
    loads: list[tuple[int, Page]] = dataclasses.field(default_factory=list)  # tier -> page
    # LoRA adapters to write into device slots before the step: (slot, adapter key)
    lora_loads: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    # Copy-on-write: (source, destination) pages to copy before the step (kv.page_pool).
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: PagePool,
        *,
        page_size: int,
        seed: int = 0,
        spec_max_batch: int = 0,
        tier: KVTier | None = None,
        token_buckets: tuple[int, ...] = (),
        kv: KVGroups | None = None,
        lora: SlotTable | None = None,
    ):
        """`kv`: the KV cache's layer groups (a hybrid cache), `pool` their group 0's;
        by default one group, `pool`."""
        self.pool = pool
        self.kv = KVGroups.single(pool, page_size) if kv is None else kv
        if self.kv.pools[0] is not pool:
            raise ValueError("the scheduler's pool must be its KV groups' group 0")
        self.lora = lora
        self.tier = tier
        # The step programs' token counts (the runner pads a step to the next one): a
        # step is fitted to them by `_fit_to_bucket`; empty: steps are not fitted.
        self.token_buckets = tuple(sorted(token_buckets))
        self.spec_max_batch = spec_max_batch  # speculate only up to this many running
        self.page_size = page_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: list[SequenceState] = []  # sorted by SequenceState.sort_key
        self.running: list[SequenceState] = []  # in admission order
        # Test mode: preempt a random running sequence at random steps.
        self.debug_preemption_rate = config.debug_preemption_rate
        self._rng = random.Random(seed)
        self.num_preemptions = 0
        # Prefix-cache metrics, counted once per sequence at its first admission (a
        # head-of-line sequence that waits for pages is looked up again each step).
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    # ---------------------------------------------------------------- queueing

    def add(self, seq: SequenceState) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=SequenceState.sort_key)

    def finish(self, seq: SequenceState, reason: str) -> None:
        """Ends a sequence (finished or aborted) and releases its pages."""
        if seq.status is Status.RUNNING:
            self._stop_running(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.kv.release(seq)
        seq.page_uids, seq.page_digests = [], []
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- planning

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[SequenceState] = []
        if self.running and self._rng.random() < self.debug_preemption_rate:
            victim = self._rng.choice(self.running)
            self._preempt(victim)
            preempted.append(victim)

        i = 0
        # (Running sequences fit max_num_seqs by admission's seats; the bound is a guard.)
        while i < len(self.running) and budget > 0 and len(scheduled) < self.max_num_seqs:
            seq = self.running[i]
            todo = seq.num_tokens + seq.num_placeholders - seq.num_computed
            if todo <= 0 or len(seq.output_ids) + seq.num_placeholders >= seq.max_tokens:
                # Asynchronous scheduling: the in-flight step samples its last token.
                i += 1
                continue
            n = min(todo, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = max(self.running[i:], key=SequenceState.sort_key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n
                i += 1

        if len(self.running) <= self.spec_max_batch:
            budget = self._add_drafts(scheduled, budget)
        loads: list[tuple[int, Page]] = []
        if not preempted:
            budget = self._admit(budget, scheduled, loads)
        if not scheduled and self.waiting and sharing.all_idle_beams(self.running):
            # Beam searches wait for group-mates that wait for the pages they hold: the
            # newest search makes way, all its beams (they recompute when readmitted).
            newest = max(self.running, key=SequenceState.sort_key)
            for seq in sharing.group_of(self.running, newest):
                self._preempt(seq)
                preempted.append(seq)
        plan = SchedulerOutput(self._fit_to_bucket(scheduled), preempted, loads)
        plan.copies = self.pool.take_copies()
        if self.lora is not None:
            plan.lora_loads = self.lora.take_loads()
        return plan

    def _fit_to_bucket(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Shortens prefill chunks so the step fills the token bucket below it, when
        the padding up to the bucket above would be larger than the tokens deferred.

        The runner pads a step to the next token bucket (powers of two), and a padded
        token costs what a real one does: 300 tokens run as 512 (a decode batch plus
        one new prompt typically lands just past a power of two). Cut to 256, the 44
        deferred prompt tokens ride along with the next step's decodes instead. Only
        prefill chunks shrink, from the last one back, each to at least one token
        (its pages stay allocated for the rest); decodes and drafts never do. So a
        step that has prompt tokens to spare fills at least 3/4 of its bucket.
        """
        total = sum(s.num_tokens for s in scheduled)
        above = next((b for b in self.token_buckets if b >= total), None)
        below = max((b for b in self.token_buckets if b < total), default=None)
        if above is None or below is None or above - total <= total - below:
            return scheduled
        excess = total - below
        fitted = list(scheduled)
        for j in range(len(fitted) - 1, -1, -1):
            item = fitted[j]
            if item.draft or item.num_tokens <= 1:
                continue
            cut = min(excess, item.num_tokens - 1)
            fitted[j] = ScheduledSeq(item.seq, item.start, item.num_tokens - cut)
            excess -= cut
            if excess == 0:
                return fitted
        return scheduled  # not enough prefill to cut: keep the step as planned

    def _seats(self) -> tuple[int, set[str]]:
        """Running slots held, and the beam searches holding them (`SequenceState.seats`)."""
        held, groups = 0, set()
        for seq in self.running:
            if seq.seats == 1:
                held += 1
            elif seq.request_id not in groups:
                held += seq.seats
                groups.add(seq.request_id)
        return held, groups

    def _admit(
        self, budget: int, scheduled: list[ScheduledSeq], loads: list[tuple[int, Page]]
    ) -> int:
        blocked, horizon = [], 0
        if self.lora is not None and self.waiting:
            self.lora.keep_reservations({s.lora_key for s in self.waiting if s.lora_key})
            horizon = max(s.arrival for s in self.waiting)
        held, groups = self._seats()
        while self.waiting and budget > 0 and held < self.max_num_seqs:
            seq = self.waiting[0]
            donor = sharing.donor(self.running, seq)
            if seq.num_placeholders or (
                donor is not None
                and donor.num_computed < donor.num_prompt_tokens
                and (donor.status is not Status.FINISHED)
            ):
                # An n > 1 sibling (or a beam) waits for the first sample (a group-mate)
                # to compute the prompt, then shares it; a preempted sequence waits for
                # the token an in-flight step samples.
                blocked.append(self.waiting.pop(0))
                continue
            seats = 0 if seq.request_id in groups else seq.seats
            if held + seats > self.max_num_seqs:
                break
            slot = 0
            if seq.lora_key is not None:
                # (its adapter may be written now, or a slot reserved for it)
                slot = self.lora.claim(seq.lora_key, seq.arrival, horizon)
                if slot is None:  # no slot for its adapter yet
                    blocked.append(self.waiting.pop(0))
                    continue
            n = self._fork_prompt(seq, donor, budget)
            if n is not None:  # one prefill for the n samples (copy-on-write)
                self.waiting.pop(0)
                self._start(seq, slot, seq.num_computed, n, scheduled, groups)
                held += seats
                budget -= n
                continue
            # Prompt logprobs need every prompt position's logits: no cached prefix.
            cacheable = seq.num_tokens - 1 if seq.params.prompt_logprobs is None else 0
            hit = self.kv.lookup(seq, cacheable)  # (references taken: seq.pages)
            uids, digests = seq.page_uids, seq.page_digests
            in_tier = self._in_tier(seq, digests, cacheable) if self.tier is not None else []
            computed = (hit + len(in_tier)) * self.page_size
            n = min(seq.num_tokens - computed, budget)
            if not self.kv.fits(seq, computed + n):
                self.kv.release(seq)
                seq.page_uids, seq.page_digests = [], []
                break
            if in_tier:  # read and checked now: a page refused ends the run there
                in_tier = self.tier.load(in_tier, seq.salt)
                computed = (hit + len(in_tier)) * self.page_size
                n = min(seq.num_tokens - computed, budget)
            self.waiting.pop(0)
            if not self.kv.grow(seq, computed + n):  # (fits above, and needs no more now)
                raise RuntimeError(f"{seq.request_id}: pages checked free were not")
            for page_id, page in zip(seq.pages[hit:], in_tier, strict=False):
                parent = uids[-1] if uids else ROOT_UID
                name = (page.digest, page.parent)
                uids.append(self.pool.cache_page(page_id, parent, page.tokens, seq.salt, name))
                digests.append(page.digest)
                loads.append((page_id, page))
            seq.num_computed = computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
                self.prefix_queries += cacheable
                self.prefix_hits += computed
            self._start(seq, slot, computed, n, scheduled, groups)
            held += seats
            budget -= n
        for seq in blocked:
            bisect.insort(self.waiting, seq, key=SequenceState.sort_key)
        return budget

    def _in_tier(self, seq: SequenceState, digests: list[bytes], limit: int) -> list[bytes]:
        """The digests of the full pages after the device's cached ones (`digests`), up
        to `limit` tokens, that the tier holds, in order up to the first it lacks."""
        page, found = self.page_size, []
        parent = digests[-1] if digests else ROOT_DIGEST
        for start in range(len(digests) * page, limit - page + 1, page):
            parent = page_digest(parent, seq.token_ids[start : start + page], seq.salt)
            if not self.tier.contains(parent):
                break
            found.append(parent)
        return found

    def _add_drafts(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        """Gives decoding sequences their proposed tokens from what the real tokens
        left: the budget and the free pages (a sequence that cannot get pages for
        all of its drafts takes those its pages already hold; nobody is preempted
        for a draft). Returns the budget left."""
        page = self.page_size
        for j, item in enumerate(scheduled):
            seq = item.seq
            if budget <= 0:
                break
            if not seq.spec_token_ids or item.num_tokens != 1 or not item.samples:
                continue
            draft = seq.spec_token_ids[:budget]
            if not self._grow(seq, seq.num_tokens + len(draft)):
                draft = draft[: len(seq.pages) * page - seq.num_tokens]
            if draft:
                scheduled[j] = ScheduledSeq(seq, item.start, 1 + len(draft), tuple(draft))
                budget -= len(draft)
        return budget

    def _grow(self, seq: SequenceState, num_tokens: int) -> bool:
        """Gives `seq` pages for `num_tokens` tokens, and its own copy of each shared
        page among those it writes (from `num_computed` on); False if a pool cannot.
        (Pages are shared with one layer group only: a hybrid KV cache never forks.)"""
        if len(self.kv.pools) > 1:
            return self.kv.grow(seq, num_tokens)
        pages = seq.pages
        need = -(-num_tokens // self.page_size) - len(pages)
        first = seq.num_computed // self.page_size
        if need <= 0 and first == len(pages) + need - 1 and self.pool.ref_count(pages[first]) == 1:
            return True  # (a decode's: it writes one page, its own)
        shared = sharing.shared_pages(
            self.pool, seq.pages, seq.num_computed, num_tokens, self.page_size
        )
        if max(need, 0) + len(shared) > self.pool.num_free:
            return False
        for j in shared:
            seq.pages[j] = self.pool.copy_on_write(seq.pages[j])
        if need > 0:
            seq.pages.extend(self.pool.allocate(need))
        return True

    def _fork_prompt(self, seq: SequenceState, donor, budget: int) -> int | None:
        """Admits an n > 1 sample onto its first sample's prompt pages (a beam onto a
        group-mate's, unless the prefix cache finds them), if that one runs with them
        computed (`kv.sharing.fork_prompt`); returns the tokens it computes now, or None
        (it holds nothing) if it cannot fork or get the pages it writes."""
        if donor is None or donor.status is not Status.RUNNING or seq.num_prompt_tokens < 2:
            return None
        if self.kv.windowed:  # (pages before a window are gone; the prefix cache shares)
            return None
        if donor.num_computed < seq.num_prompt_tokens - 1:
            return None
        if seq.leader is None and self.pool.enable_prefix_caching:
            return None  # (a lookup shares the beams' generated pages too)
        sharing.fork_prompt(self.pool, seq, donor, self.page_size)
        n = min(seq.num_tokens - seq.num_computed, budget)
        if self._grow(seq, seq.num_computed + n):
            return n
        sharing.release(self.pool, seq)
        return None

    def fork(self, parent: SequenceState, index: int) -> SequenceState:
        """A new sequence continuing `parent` (a beam search's new beam): running beside
        it on its computed pages, shared by reference, or waiting with it if `parent`
        waits (preempted: both recompute)."""
        running = parent.status is Status.RUNNING
        pages = self.pool.fork(sharing.computed_pages(parent, self.page_size)) if running else []
        child = parent.fork(index, pages, self.page_size)
        if running:
            self.running.append(child)
        else:
            child.num_computed = child.draft_computed = 0
            self.add(child)
        return child

    def check_invariant(self) -> None:
        """The pool's page accounting, and each page's references against the live
        sequences holding it (`PagePool.check_invariant`)."""
        self.pool.check_invariant(owners=[s.pages for s in self.running + self.waiting])

    def preempt_all(self) -> int:
        """Preempts every running sequence (its pages freed, its work recomputed when
        it runs again): the KV it held is gone (`LLMEngine.sleep`) or stale (new
        weights). Returns how many."""
        running = list(self.running)
        for seq in running:
            self._preempt(seq)
        return len(running)

    def _start(
        self,
        seq: SequenceState,
        slot: int,
        computed: int,
        n: int,
        scheduled: list[ScheduledSeq],
        groups: set[str],
    ) -> None:
        """An admitted `seq` joins the running batch, its adapter in device slot `slot`
        (0: none), computing `n` tokens from `computed` this step; a beam search's
        first running sequence takes its group's seats (`groups`)."""
        seq.status = Status.RUNNING
        self.running.append(seq)
        seq.lora_slot = slot
        if slot:
            self.lora.pin(slot)
        if seq.seats > 1:
            groups.add(seq.request_id)
        scheduled.append(ScheduledSeq(seq, computed, n))

    def _stop_running(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        if seq.lora_slot:
            self.lora.unpin(seq.lora_slot)
            seq.lora_slot = 0

    def _preempt(self, seq: SequenceState) -> None:
        self._stop_running(seq)
        self.kv.release(seq)
        seq.page_uids, seq.page_digests = [], []
        seq.num_computed = seq.draft_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # --------------------------------------------------------------- after step

    def on_computed(self, item: ScheduledSeq, num_accepted: int = 0) -> None:
        """Advances a sequence past its computed chunk (of its drafts, the first
        `num_accepted`, which the caller has appended) and caches the pages it filled."""
        seq = item.seq
        seq.num_computed = item.start + item.num_tokens - len(item.draft) + num_accepted
        page = self.page_size
        if item.draft:
            # The rejected drafts' pages: those past the sequence's tokens.
            self.kv.truncate(seq, -(-seq.num_tokens // page))
            seq.draft_computed = min(seq.draft_computed, seq.num_computed)
        self.cache_pages(seq)

    def cache_pages(self, seq: SequenceState) -> None:
        """Caches the sequence's full pages whose tokens are computed and known (under
        asynchronous scheduling a computed token may not be back on the host yet: its
        page is cached once it is), in every layer group; then windowed groups give
        back the cached pages out of the sequence's window (`KVGroups.free_dead`)."""
        page = self.page_size
        full = min(seq.num_computed, seq.num_tokens) // page
        if full <= len(seq.page_uids) and not self.kv.windowed:
            return  # (most calls: no page filled since the last)
        for j in range(len(seq.page_uids), full):
            parent = seq.page_uids[-1] if seq.page_uids else ROOT_UID
            tokens = seq.token_ids[j * page : (j + 1) * page]
            parent_digest = seq.page_digests[-1] if seq.page_digests else ROOT_DIGEST
            name = (page_digest(parent_digest, tokens, seq.salt), parent_digest)
            seq.page_uids.append(self.pool.cache_page(seq.pages[j], parent, tokens, seq.salt, name))
            seq.page_digests.append(name[0])
            if seq.group_pages:
                self.kv.cache_group_pages(seq, j, parent, tokens, name)
        if self.kv.windowed:
            self.kv.free_dead(seq)
