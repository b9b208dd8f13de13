"""On-device sampling: every request's own settings, in one batch, in one program.

Processing follows vLLM's order and semantics: logit bias, the allowed-token
bitmask (the tokens min_tokens blocks), repetition / frequency / presence
penalties, temperature,
min-p, top-k and top-p, then a draw. Greedy rows (temperature 0) take the argmax
of the processed logits. A row's randomness comes only from its own seed and
its own output position (`fold_in(key(seed), position)`), so a seeded request
samples the same tokens whatever its batch neighbours are.

The costly parts (the processed copy of [B, V] that bias and penalties need,
penalty counts, the random draw and the sort for top-k/top-p, the logprobs) run
under `lax.cond`, so a batch that does not ask for them does not pay for them,
and no setting changes the compiled program.

Logprobs are those of the raw model distribution (log-softmax of the logits),
as vLLM returns by default.

Speculative decoding: a row with a `draft` token verifies it against the row's
processed distribution p (the same processing as a normal draw). Proposals are
deterministic (q one-hot), so the standard rejection rule reads: accept the draft
with probability p(draft); on rejection, draw from p with the draft removed,
renormalized (normalize(max(0, p - q))). `verify` realises it with the row's own
draw: the emitted token is always distributed exactly as p, and is the token the
row would emit without speculation. Greedy rows accept when the argmax equals
the draft. A row without a draft draws as usual (the bonus token after a fully
accepted run).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.runner.input_batch import MAX_TOP_LOGPROBS, SamplingMetadata

# Built on the host (JAX-free) in input_batch; a pytree of data fields here.
jax.tree_util.register_dataclass(
    SamplingMetadata,
    data_fields=[f.name for f in dataclasses.fields(SamplingMetadata)],
    meta_fields=[],
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32: raw logprob of each sampled token (0 unless asked)
    top_ids: jax.Array  # [B, 20] i32 (zeros unless requested)
    top_logprobs: jax.Array  # [B, 20] f32
    accepted: jax.Array  # [B] bool: the row's draft was accepted (its token is the draft)


def _apply_penalties(logits, md: SamplingMetadata):
    b, v = logits.shape
    hist = md.history
    valid = hist >= 0
    is_output = valid & (jnp.arange(hist.shape[1])[None, :] >= md.num_prompt[:, None])
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], hist.shape)
    ids = jnp.where(valid, hist, 0)
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, ids].max(valid)
    counts = jnp.zeros((b, v), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * counts
    return logits - md.presence_penalty[:, None] * (counts > 0)


def _top_k_top_p(logits, md: SamplingMetadata):
    """Masks what falls outside each row's top-k, then outside the top-p nucleus of
    what top-k kept, renormalized (vLLM's order; ties at either edge kept)."""
    v = logits.shape[1]
    ordered = -jnp.sort(-logits, axis=-1)  # descending
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, v), v)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    in_k = ordered >= kth
    probs = jax.nn.softmax(jnp.where(in_k, ordered, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each entry
    keep = (before < md.top_p[:, None]) & in_k
    # The smallest kept value; keep is never empty (the first entry always passes).
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _draw(x, md: SamplingMetadata):
    """Temperature, min-p, top-k/top-p, then a Gumbel-max draw from each row's own
    key, which also decides a row's draft (`verify`). Returns (tokens, accepted)."""
    v = x.shape[1]
    greedy = md.temperature <= 0.0
    x = x / jnp.where(greedy, 1.0, md.temperature)[:, None]
    probs = jax.nn.softmax(x, axis=-1)
    x = jnp.where(probs < md.min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, x)
    needs_sort = jnp.any(((md.top_k > 0) & (md.top_k < v)) | (md.top_p < 1.0))
    x = lax.cond(needs_sort, _top_k_top_p, lambda x, md: x, x, md)

    def gumbel(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.gumbel(key, (v,), jnp.float32)

    return verify(x, md.draft, jax.vmap(gumbel)(md.seed, md.position))


def verify(x, draft, noise):
    """The rejection rule for deterministic proposals (q one-hot), on processed logits
    x [B, V] (-inf where excluded) and each row's Gumbel noise [B, V].

    The row's token is its Gumbel-max draw t = argmax(x + noise), a sample of
    p = softmax(x), and its draft is accepted when t equals it. That is the standard
    rule read for a one-hot q: the draft is accepted with probability p(draft), and
    on rejection t is distributed as p with the draft removed, renormalized
    (normalize(max(0, p - q))). As it couples the verdict to the draw a row makes
    anyway, a seeded request emits the same tokens whether or not its step
    speculated (speculation depends on the batch). Returns (tokens [B] i32,
    accepted [B] bool); rows without a draft (-1) are never accepted.
    """
    tokens = argmax(x + noise)
    return tokens, (draft >= 0) & (tokens == draft)


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the maximum), as int32.

    XLA:CPU runs jnp.argmax's (value, index) reduction unvectorised: 11.6 ms for
    [16, 151936] where a max followed by a min over the indices that hold it takes
    2.0 ms (2 cores of an AMD EPYC). A row holding NaN gets the last index, not
    the NaN's.
    """
    v = x.shape[-1]
    top = x.max(axis=-1, keepdims=True)
    index = jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v)
    return jnp.minimum(index.min(axis=-1), v - 1)


def _penalized(md: SamplingMetadata) -> jax.Array:
    """[B] bool: rows with a repetition, frequency or presence penalty."""
    return (
        (md.repetition_penalty != 1.0)
        | (md.frequency_penalty != 0.0)
        | (md.presence_penalty != 0.0)
    )


def _apply_bias(logits, md: SamplingMetadata):
    """logit_bias: [B, NB] sparse (token, value) pairs added to the rows' logits."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, md.bias_ids].add(md.bias_values)


def _apply_mask(logits, md: SamplingMetadata):
    """-inf where a row's allowed-token bitmask [B, ceil(V/32)] has the bit clear."""
    b, v = logits.shape
    bits = (md.allowed[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # [B, W, 32]
    allowed = bits.reshape(b, -1)[:, :v].astype(jnp.bool_)
    return jnp.where(allowed | ~md.masked[:, None], logits, -jnp.inf)


def _process_and_sample(logits, md: SamplingMetadata):
    """Logit bias, the bitmask, penalties, then the argmax (greedy rows) or a draw."""
    x = lax.cond(jnp.any(md.bias_values != 0.0), _apply_bias, lambda x, md: x, logits, md)
    x = lax.cond(jnp.any(md.masked), _apply_mask, lambda x, md: x, x, md)
    x = lax.cond(jnp.any(_penalized(md)), _apply_penalties, lambda x, md: x, x, md)

    # Greedy rows need none of the rest: min-p, top-k and top-p never remove the argmax.
    greedy = md.temperature <= 0.0
    best = argmax(x)
    drawn, accepted = lax.cond(
        jnp.all(greedy), lambda x, md: (best, best == md.draft), _draw, x, md
    )
    return jnp.where(greedy, best, drawn), jnp.where(greedy, best == md.draft, accepted)


def sample(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
    """logits [B, V] float32 -> one token per row, with logprobs where asked."""
    # A batch of plain greedy rows (no bias, no penalty) takes the argmax of the raw
    # logits: no processed copy of [B, V] is made.
    plain = jnp.all(
        (md.temperature <= 0.0)
        & jnp.all(md.bias_values == 0.0, axis=-1)
        & ~md.masked
        & ~_penalized(md)
    )
    sampled, accepted = lax.cond(plain, _plain_greedy, _process_and_sample, logits, md)

    chosen, top_ids, top_vals = lax.cond(
        md.want_logprobs[0],
        lambda x: token_logprobs(x, sampled),
        lambda x: no_logprobs(x.shape[0]),
        logits,
    )
    return SamplerOutput(sampled, chosen, top_ids, top_vals, accepted)


def _plain_greedy(logits, md: SamplingMetadata):
    best = argmax(logits)
    return best, best == md.draft


def token_logprobs(logits: jax.Array, token_ids: jax.Array):
    """Raw logprobs of rows [R, V]: of each row's `token_ids` [R], and the top
    MAX_TOP_LOGPROBS (ids, values)."""
    raw = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0]
    vals, ids = lax.top_k(raw, MAX_TOP_LOGPROBS)
    return chosen, ids.astype(jnp.int32), vals


def no_logprobs(rows: int):
    """`token_logprobs`'s zeros, for the branch of a `lax.cond` that skips it."""
    return (
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, MAX_TOP_LOGPROBS), jnp.int32),
        jnp.zeros((rows, MAX_TOP_LOGPROBS), jnp.float32),
    )
