"""Seeded synthetic workloads: random, ShareGPT-like, shared-prefix."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def _ids(rs: np.random.RandomState, n: int, vocab: int) -> list[int]:
    # Skip the lowest ids, where tokenizers keep their special tokens.
    return rs.randint(min(16, vocab - 1), vocab, size=n).tolist()


def _lengths(rs, n: int, mean: int, range_ratio: float) -> np.ndarray:
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rs.randint(lo, hi + 1, size=n)


def random_workload(
    num: int, *, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int = 0
) -> list[BenchRequest]:
    """Lengths uniform in [len * (1 - ratio), len * (1 + ratio)], vLLM's `random` dataset."""
    rs = np.random.RandomState(seed)
    ins, outs = (
        _lengths(rs, num, input_len, range_ratio),
        _lengths(rs, num, output_len, range_ratio),
    )
    return [BenchRequest(_ids(rs, int(i), vocab), int(o)) for i, o in zip(ins, outs, strict=True)]


def sharegpt_like(num: int, *, vocab: int, max_len: int, seed: int = 0) -> list[BenchRequest]:
    """Log-normal prompt and reply lengths shaped like ShareGPT conversations (medians
    about 200 and 150 tokens, long tails), generated locally: no dataset download."""
    rs = np.random.RandomState(seed)
    ins = np.clip(rs.lognormal(np.log(200), 1.0, num), 4, max_len // 2).astype(int)
    outs = np.clip(rs.lognormal(np.log(150), 0.9, num), 4, max_len // 2).astype(int)
    return [BenchRequest(_ids(rs, int(i), vocab), int(o)) for i, o in zip(ins, outs, strict=True)]


def shared_prefix(
    num: int,
    *,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests that share one of a few long system prompts (prefix caching's case)."""
    rs = np.random.RandomState(seed)
    prefixes = [_ids(rs, prefix_len, vocab) for _ in range(num_prefixes)]
    return [
        BenchRequest(prefixes[i % num_prefixes] + _ids(rs, suffix_len, vocab), output_len)
        for i in range(num)
    ]


def passages_from_python_docs(tokenize, *, min_tokens: int, count: int = 64) -> list[list[int]]:
    """Real English text that every Python installation holds: the help topics of
    `pydoc_data` (the language reference's sections), tokenized, longest first."""
    from pydoc_data.topics import topics

    texts = sorted(topics.values(), key=len, reverse=True)[: 4 * count]
    out = [ids for ids in (tokenize(t) for t in texts) if len(ids) >= min_tokens]
    if not out:
        raise ValueError(f"no pydoc topic has {min_tokens} tokens")
    return out[:count]


def grounded(
    num: int,
    *,
    passages: list[list[int]],
    instruction: list[int],
    separator: list[int],
    input_len: int,
    output_len: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Input-grounded requests: "repeat this passage", whose answer copies the prompt
    (the case prompt lookup speeds up; edits and extraction behave alike). Each
    prompt is the instruction, a passage of `input_len` tokens from a random place
    in real text, the separator, and the passage's first few tokens to start the copy.
    """
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(num):
        text = passages[rs.randint(len(passages))]
        start = rs.randint(max(1, len(text) - input_len))
        passage = text[start : start + input_len]
        out.append(BenchRequest(instruction + passage + separator + passage[:8], output_len))
    return out
