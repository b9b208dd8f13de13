"""A model runner whose next token is computable by hand (JetStream's mock-engine idea).

Each sequence's next token is (sum of all its tokens so far) mod vocab, so the
right output depends on the whole history: a token lost, duplicated or mixed
between sequences by the scheduler changes every later token. It also checks,
at every step, that the plan only computes tokens that follow what is cached.

With `group_pages` it stands for a hybrid KV cache (`config.kv_groups`): each layer
group's pages hold their own copy of the tokens, and each row checks, in every
group, the positions that group's attention reads (a windowed group: its window).
"""

from __future__ import annotations

import types

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.runner.input_batch import (
    SamplingMetadata,
    StepShapes,
    build_batch,
    build_sampling,
    pick_bucket,
)


def mock_model(**hf) -> ModelConfig:
    """A model for the mock runner (it reads only the config): a one-layer Llama,
    8 wide, of 1000 tokens; `hf` overrides or adds config.json fields."""
    config = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=1000,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        max_position_embeddings=256,
    )
    return ModelConfig.from_hf({**config, **hf})


def mock_candidates(history: list[int], vocab: int) -> tuple[list[int], list[float]]:
    """The mock's top 20 next tokens after `history`, best first, with logprobs: what
    a beam search's row gets (distinct ids; scores that differ between histories)."""
    s = sum(history)
    ids = [(s * 31 + j * 7) % vocab for j in range(20)]
    return ids, [-0.3 * (j + 1) - 0.01 * ((s + j) % 13) for j in range(20)]


def expected_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(sum(ids) % vocab)
        ids.append(out[-1])
    return out


class MockRunner:
    accelerator = False  # (a CPU's: scheduling is synchronous unless asked)

    def __init__(self, config, num_pages: int, group_pages: tuple[int, ...] | None = None):
        self.config = config
        self.num_pages = num_pages
        self.windows: list[int | None] = [None]
        if group_pages is not None:  # a hybrid KV cache: a pool per layer group
            self.group_pages = group_pages
            self.windows = [g.window for g in config.kv_groups]
            assert len(group_pages) == len(self.windows)
        self.kv_tokens = (num_pages - 1) * config.cache.page_size
        self.max_concurrency = self.kv_tokens / config.max_model_len
        self.vocab = config.model.vocab_size
        self.shapes = StepShapes.for_config(config)
        self.weight_bytes = 0
        self.warmup_seconds = 0.0
        self.warmed_up = False
        self.warmup_cache_hits = 0
        self.mesh = None
        self.compile_device = None
        self.drafter = None
        self.lora = None  # (serves no LoRA adapters)
        self.layout = {"tp": 1, "devices": 1, "processes": 1}
        self.kv_bytes_per_device = 0
        self.compiles = types.SimpleNamespace(count=0)
        # What each page slot holds: (page, offset) -> token id; checks the KV bookkeeping.
        self.slots: dict = {}
        self.steps = 0
        self.closed = False
        self._copies: list = []
        self.copies_made = 0  # copy-on-write page copies applied

    def row_bucket(self, num_rows):
        return pick_bucket(num_rows, self.shapes.row_buckets, what="sampling rows")

    def build(self, work, copies=()):
        num_tokens = sum(len(w.token_ids) for w in work)
        self._copies = list(copies)
        t = pick_bucket(num_tokens, self.shapes.token_buckets, what="tokens")
        self._work = work
        return build_batch(
            work,
            page_size=self.config.cache.page_size,
            pages_per_seq=self.config.pages_per_seq,
            token_bucket=t,
            seq_bucket=self.shapes.max_seqs,  # the fixed sizes, as the real runner
            num_rows=self.shapes.max_rows,
            num_groups=len(getattr(self, "group_pages", (num_tokens,))),
        )

    def build_sampling(self, rows, row_bucket, errors=None) -> SamplingMetadata:
        self._rows = rows
        return build_sampling(
            rows,
            seq_bucket=row_bucket,
            history_len=self.config.pages_per_seq * self.config.cache.page_size,
            max_bias=self.config.max_logit_bias,
            vocab_size=self.vocab,
            errors=errors,
        )

    def warmup(self):
        pass

    def close(self):
        self.closed = True

    # KV pages that travel (the host/disk tier): a page is the tokens its slots hold.

    def kv_layout(self):
        from jaxserve.kv.transfer import ArraySpec, KVLayout

        page = self.config.cache.page_size
        return KVLayout("mock", page, (ArraySpec("kv", "int64", (page,)),))

    def gather_pages(self, pages):
        page = self.config.cache.page_size
        kv = [[self.slots.get(p * page + i, -1) for i in range(page)] for p in pages]
        return {"kv": np.asarray(kv, np.int64)}

    def scatter_pages(self, pages, arrays):
        page = self.config.cache.page_size
        for p, a in zip(pages, arrays, strict=True):
            for i, tok in enumerate(a["kv"]):
                self.slots[p * page + i] = int(tok)

    def _slot(self, group: int, table, pos: int):
        """Where position `pos` sits in group `group`'s pages (group 0: the plain slot
        number, which the KV tier's gather and scatter read)."""
        page = self.config.cache.page_size
        slot = table[pos // page] * page + pos % page
        return slot if group == 0 else (group, slot)

    @staticmethod
    def fetch(pending):
        return pending.out, pending.prompt_lp

    def dispatch(self, batch, sampling, prev=None):
        """`prev`: the step before, not fetched (asynchronous scheduling): a work item's
        `prev_row` names the row of its sampled tokens that is the item's last token."""
        if callable(sampling):  # as ModelRunner: built once the forward is dispatched
            sampling = sampling()
        self.steps += 1
        page_size = self.config.cache.page_size
        for src, dst in self._copies:  # copy-on-write, before the step's writes
            for i in range(page_size):
                if src * page_size + i in self.slots:
                    self.slots[dst * page_size + i] = self.slots[src * page_size + i]
                else:
                    self.slots.pop(dst * page_size + i, None)
        self.copies_made += len(self._copies)
        token_ids = np.zeros(len(self._rows), np.int32)
        accepted = np.zeros(len(self._rows), np.bool_)
        rows = iter(enumerate(self._rows))
        for w in self._work:
            known = list(w.token_ids)
            if w.prev_row >= 0:
                known[-1] = int(prev.tokens[w.prev_row])
            tables = [w.pages, *w.group_pages]
            for j, tok in enumerate(known):
                pos = w.start + j
                for g, table in enumerate(tables):
                    assert table[pos // page_size] != 0, f"group {g} writes the null page"
                    self.slots[self._slot(g, table, pos)] = tok
            # The sequence's history, read back through each group's page table (a
            # window: the positions it sees); the last num_samples tokens each predict
            # one (drafts are verified against them).
            end = w.start + len(w.token_ids)
            for k in range(w.num_samples):
                i, row = next(rows)
                upto = end - w.num_samples + k + 1
                # (-2 - r: a token in flight, the previous step's sampled row r)
                # (a chunk short of the end has computed only its row's first `upto`)
                known = [*row.token_ids, *row.more_ids][:upto]
                expected = [t if t >= 0 else int(prev.tokens[-2 - t]) for t in known]
                for g, table in enumerate(tables):
                    window = self.windows[g]
                    first = 0 if window is None else max(0, upto - window)
                    seen = [self.slots.get(self._slot(g, table, p)) for p in range(first, upto)]
                    assert seen == expected[first:upto], f"group {g}'s KV holds wrong tokens"
                token_ids[i] = sum(expected) % self.vocab
                accepted[i] = row.draft == token_ids[i]
        top_ids = np.zeros((len(token_ids), 20), np.int32)
        top_logprobs = np.zeros((len(token_ids), 20))
        for i, row in enumerate(self._rows):
            if row.beam > 0:  # a beam search's candidates (`mock_candidates`)
                ids = [*row.token_ids, *row.more_ids]
                history = [t if t >= 0 else int(prev.tokens[-2 - t]) for t in ids]
                top_ids[i], top_logprobs[i] = mock_candidates(history, self.vocab)
        out = types.SimpleNamespace(
            token_ids=token_ids,
            logprobs=np.zeros(len(token_ids)),
            ranks=np.ones(len(token_ids), np.int32),
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            accepted=accepted,
        )
        return types.SimpleNamespace(out=out, prompt_lp=None, tokens=token_ids)
