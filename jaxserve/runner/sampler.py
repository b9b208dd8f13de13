"""On-device sampling: every request's own settings, in one batch, in one program.

Processing follows vLLM's order and semantics: logit bias, the allowed-token
bitmask (the tokens min_tokens blocks), repetition / frequency / presence
penalties, temperature,
min-p, top-k and top-p, then a draw. Greedy rows (temperature 0) take the argmax
of the processed logits. A row's randomness comes only from its own seed and
its own output position (`fold_in(key(seed), position)`), so a seeded request
samples the same tokens whatever its batch neighbours are.

The costly parts (the processed copy of [B, V] that bias and penalties need,
penalty counts, the random draw, top-k/top-p's selection, the logprobs) run
only in a batch that asks for them: under `lax.cond`, so that no setting changes the
compiled program, or, where the host decides (`SamplingMetadata.branches`: on a GPU,
where a conditional waits for its predicate on the host), traced in or out of the
program. A part applies to the rows that ask for it alone either way.

Logprobs follow the engine's `logprobs_mode` (vLLM's; fixed for the engine's life,
so a static choice of the program): the sampled token's value, and the top
MAX_TOP_LOGPROBS values with their ids, of

- `raw_logprobs` (the default): log_softmax of the model's logits;
- `raw_logits`: the model's logits themselves;
- `processed_logprobs`: log_softmax of the logits the row's token was drawn from,
  after everything that shapes that distribution, in the order applied: logit
  bias, the allowed-token bitmask (a grammar, min_tokens' blocked EOS and stop
  ids; -inf where blocked), repetition / frequency / presence penalties, then
  temperature, min-p, top-k and top-p (-inf where they cut). As vLLM, a greedy
  row (temperature 0) samples the argmax of the logits after bias, bitmask and
  penalties, and its processed values are those: no temperature, no min-p,
  top-k or top-p (vLLM resets them for greedy requests; none changes the argmax);
- `processed_logits`: those processed logits, before log_softmax.

A beam search's rows (`SamplingMetadata.beam` > 0) take their candidates from the top
values: these rows get log_softmax(logits / beam) in every mode (the raw logprobs
at beam 1), computed only in a batch that has such a row.

A token a processed distribution excludes gets -inf: the honest value (front ends
render it in JSON as vLLM does, -9999.0). Prompt logprobs (`runner.step`) are the
raw distribution's in every mode, as logits or logprobs by the mode's suffix, as
vLLM's: no token is drawn at a prompt position, so nothing processes it.
Speculative decoding changes nothing: each verifying row is processed as the row
without speculation would be (its own history, position and seed), so its values
are those of the token's own step.

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
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.runner.input_batch import MAX_TOP_LOGPROBS, SamplingMetadata
from jaxserve.runner.packing import Layout

# Built on the host (JAX-free) in input_batch; a pytree of data fields here.
jax.tree_util.register_dataclass(
    SamplingMetadata,
    data_fields=[f.name for f in dataclasses.fields(SamplingMetadata) if f.name != "branches"],
    meta_fields=["branches"],  # (static: part of the program's key)
)


def _same(x, md: SamplingMetadata):
    return x


def _when(md: SamplingMetadata, part: str, pred, yes, no, *args):
    """`lax.cond(pred, yes, no, *args)`, or where the host decided the batch's
    branches, the branch it named for `part` alone."""
    if md.branches is None:
        return lax.cond(pred, yes, no, *args)
    return (yes if getattr(md.branches, part) else no)(*args)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32: each sampled token's value (0 unless asked), by mode
    ranks: jax.Array  # [B] i32: its rank in the row's values (1: the highest; 0 unless asked)
    top_ids: jax.Array  # [B, 20] i32 (zeros unless requested)
    top_logprobs: jax.Array  # [B, 20] f32: the top values (logprobs or logits, by mode)
    accepted: jax.Array  # [B] bool: the row's draft was accepted (its token is the draft)

    @staticmethod
    @functools.cache
    def layout(rows: int) -> Layout:
        """How `sample_step` packs the output of `rows` rows (the host unpacks it)."""
        i32, f32 = jnp.int32, jnp.float32
        sds = jax.ShapeDtypeStruct
        top = (rows, MAX_TOP_LOGPROBS)
        shapes = SamplerOutput(
            sds((rows,), i32),
            sds((rows,), f32),
            sds((rows,), i32),
            sds(top, i32),
            sds(top, f32),
            sds((rows,), bool),
        )
        return Layout.of(shapes)


@functools.cache
def prompt_logprobs_layout(rows: int) -> Layout:
    """How `prompt_logprobs_step` packs `token_logprobs` of `rows` rows."""
    sds, top = jax.ShapeDtypeStruct, (rows, MAX_TOP_LOGPROBS)
    row = (rows,)
    return Layout.of(
        (sds(row, jnp.float32), sds(row, jnp.int32), sds(top, jnp.int32), sds(top, jnp.float32))
    )


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


def _ordered_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (lax.top_k's: -0.0 below 0.0; -inf
    above 0, the key of no value but a NaN), so that values can be selected by their
    bits without a sort."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row of keys [B, V]: the largest key u with sum(weights where keys >= u)
    >= target [B] (0 where none), found 4 bits at a time: 8 passes over the row, each
    weighing the 16 values the next digit can take.

    A radix select in place of a sort: with weights 1 and target k it is the k-th
    largest key, with the probabilities and target p the smallest key of the top-p
    nucleus. A sort of the vocabulary took XLA:TPU 8-21 s to compile per sampling
    program (a v5e target, 8 rows of 128k; 0.1-0.6 s this way), and sorted every
    row of every step that cuts (2x slower on this CPU at 256 x 32k)."""
    digits = jnp.arange(16, dtype=jnp.uint32)

    def digit(i, prefix):
        shift = (28 - 4 * i).astype(jnp.uint32)
        candidates = prefix[:, None] | (digits << shift)  # [B, 16], ascending
        above = keys[:, None, :] >= candidates[:, :, None]
        mass = jnp.sum(jnp.where(above, weights[:, None, :], 0), axis=-1)
        # mass falls as the digit grows: the digit is how many past 0 still reach target
        d = jnp.sum(mass[:, 1:] >= target[:, None], axis=-1, dtype=jnp.uint32)
        return prefix | (d << shift)

    # (A loop of 8 known trips: unrolled, the small model's h100 warm-up took 33%
    # longer to compile.)
    return lax.fori_loop(0, 8, digit, jnp.zeros(keys.shape[:1], jnp.uint32))


def _top_k_top_p(logits, md: SamplingMetadata):
    """Masks what falls outside each row's top-k, then outside the top-p nucleus of
    what top-k kept, renormalized (vLLM's order; ties at either edge kept; top_p 1
    cuts nothing, however the float mass of the tail rounds)."""
    v = logits.shape[1]
    keys = _ordered_keys(jnp.where(logits == 0, 0.0, logits))  # (-0.0 ties with 0.0)
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, v), v)
    kth = _largest_key(keys, jnp.ones_like(logits), k.astype(jnp.float32))
    probs = jax.nn.softmax(jnp.where(keys >= kth[:, None], logits, -jnp.inf), axis=-1)
    # The nucleus: the values whose strictly larger ones hold less than top_p.
    nucleus = jnp.where(md.top_p < 1.0, _largest_key(keys, probs, md.top_p), 0)
    return jnp.where(keys >= jnp.maximum(kth, nucleus)[:, None], logits, -jnp.inf)


def _draw(x, md: SamplingMetadata, keep: bool = False):
    """Temperature, min-p, top-k/top-p, then a Gumbel-max draw from each row's own
    key, which also decides a row's draft (`verify`). Returns (tokens, accepted),
    and with `keep` (static) the logits drawn from [B, V] too."""
    v = x.shape[1]
    greedy = md.temperature <= 0.0
    x = x / jnp.where(greedy, 1.0, md.temperature)[:, None]
    probs = jax.nn.softmax(x, axis=-1)
    x = jnp.where(probs < md.min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, x)
    cuts = ((md.top_k > 0) & (md.top_k < v)) | (md.top_p < 1.0)  # [B]

    def cut(x, md):  # (only the rows that ask: the others keep their tail, bit for bit)
        return jnp.where(cuts[:, None], _top_k_top_p(x, md), x)

    x = _when(md, "cut", jnp.any(cuts), cut, _same, x, md)

    def gumbel(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.gumbel(key, (v,), jnp.float32)

    tokens, accepted = verify(x, md.draft, jax.vmap(gumbel)(md.seed, md.position))
    return (tokens, accepted, x) if keep else (tokens, accepted)


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


def _process_and_sample(logits, md: SamplingMetadata, keep: bool = False):
    """Logit bias, the bitmask, penalties, then the argmax (greedy rows) or a draw.
    Returns (tokens, accepted), and with `keep` (static: processed logprobs) each
    row's processed logits [B, V] (the module docstring says which)."""
    x = _when(md, "bias", jnp.any(md.bias_values != 0.0), _apply_bias, _same, logits, md)
    if md.allowed.shape[1]:  # (a plain batch has no bitmask: no row blocks a token)
        x = _when(md, "mask", jnp.any(md.masked), _apply_mask, _same, x, md)
    x = _when(md, "penalties", jnp.any(_penalized(md)), _apply_penalties, _same, x, md)

    # Greedy rows need none of the rest: min-p, top-k and top-p never remove the argmax.
    greedy = md.temperature <= 0.0
    best = argmax(x)

    def all_greedy(x, md):
        return (best, best == md.draft, x) if keep else (best, best == md.draft)

    draw = functools.partial(_draw, keep=keep)
    out = _when(md, "draw", ~jnp.all(greedy), draw, all_greedy, x, md)
    tokens = jnp.where(greedy, best, out[0])
    accepted = jnp.where(greedy, best == md.draft, out[1])
    if not keep:
        return tokens, accepted
    # A greedy row's processed logits stop before temperature (`_draw` also cut them
    # by min-p, top-k and top-p, which a greedy row does not use).
    return tokens, accepted, jnp.where(greedy[:, None], x, out[2])


def sample(
    logits: jax.Array, md: SamplingMetadata, logprobs_mode: str = "raw_logprobs"
) -> SamplerOutput:
    """logits [B, V] float32 -> one token per row, with logprobs where asked, as
    `logprobs_mode` (static; the module docstring) says."""
    # A batch of plain greedy rows (no bias, no penalty) takes the argmax of the raw
    # logits: no processed copy of [B, V] is made.
    plain = jnp.all(
        (md.temperature <= 0.0)
        & jnp.all(md.bias_values == 0.0, axis=-1)
        & ~md.masked
        & ~_penalized(md)
    )
    as_logits = logprobs_mode.endswith("logits")

    def draw(logits, md):
        return _when(md, "plain", plain, _plain_greedy, _process_and_sample, logits, md)

    if not logprobs_mode.startswith("processed"):
        sampled, accepted = draw(logits, md)
        values = _when(
            md,
            "logprobs",
            md.want_logprobs[0],
            lambda x: token_logprobs(x, sampled, as_logits=as_logits),
            lambda x: no_logprobs(x.shape[0]),
            logits,
        )
        return _beam_rows(logits, md, SamplerOutput(sampled, *values, accepted))

    # Processed: the processed logits [B, V] leave the sampling branches, a copy that
    # only a batch asking for logprobs makes (another branch of the same program).
    def with_logprobs(logits, md):
        sampled, accepted, scores = _when(
            md,
            "plain",
            plain,
            lambda x, md: (*_plain_greedy(x, md), x),
            functools.partial(_process_and_sample, keep=True),
            logits,
            md,
        )
        return sampled, accepted, *token_logprobs(scores, sampled, as_logits=as_logits)

    def without(logits, md):
        return *draw(logits, md), *no_logprobs(logits.shape[0])

    sampled, accepted, *values = _when(
        md, "logprobs", md.want_logprobs[0], with_logprobs, without, logits, md
    )
    return _beam_rows(logits, md, SamplerOutput(sampled, *values, accepted))


def _beam_rows(logits, md: SamplingMetadata, out: SamplerOutput) -> SamplerOutput:
    """`out` with a beam search's rows' values replaced by log_softmax(logits / beam):
    the candidates' scores, whatever the mode (a batch without such rows skips it)."""
    beam = md.beam > 0.0

    def replace(out: SamplerOutput) -> SamplerOutput:
        scaled = logits / jnp.where(beam, md.beam, 1.0)[:, None]
        chosen, ranks, top_ids, top_vals = token_logprobs(scaled, out.token_ids)
        return dataclasses.replace(
            out,
            logprobs=jnp.where(beam, chosen, out.logprobs),
            ranks=jnp.where(beam, ranks, out.ranks),
            top_ids=jnp.where(beam[:, None], top_ids, out.top_ids),
            top_logprobs=jnp.where(beam[:, None], top_vals, out.top_logprobs),
        )

    return _when(md, "beam", jnp.any(beam), replace, lambda out: out, out)


def _plain_greedy(logits, md: SamplingMetadata):
    best = argmax(logits)
    return best, best == md.draft


def token_logprobs(logits: jax.Array, token_ids: jax.Array, *, as_logits: bool = False):
    """The values of rows of logits [R, V]: log_softmax (or with `as_logits`, static,
    the logits themselves); of each row's `token_ids` [R] with their ranks (vLLM's:
    how many of the row's values are at least the token's, so 1 is the highest), and
    the top MAX_TOP_LOGPROBS (ids, values)."""
    values = logits if as_logits else jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(values, token_ids[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(values >= chosen[:, None], axis=-1, dtype=jnp.int32)
    ids = top_ids(values, MAX_TOP_LOGPROBS)
    return chosen, ranks, ids, jnp.take_along_axis(values, ids, axis=-1)


def top_ids(x: jax.Array, k: int) -> jax.Array:
    """`lax.top_k(x, k)[1]` for x [R, V] (descending, the lowest index first among
    equals); on a TPU without a sort (`_top_ids_by_passes`). XLA:TPU rewrites
    lax.top_k as a sort of the whole row, which it took 3-6 s to compile per program
    (64 rows, a v5e target), and which sorts [T, V] for T prompt tokens. XLA:GPU
    compiles its sort in about a second and the passes slower (unrolled, they made the
    small model's h100 warm-up compile 44% longer); XLA:CPU has a top-k of its own,
    15x faster here than the passes (16 x 152k)."""
    return lax.platform_dependent(
        x,
        tpu=functools.partial(_top_ids_by_passes, k=k),
        default=lambda x: lax.top_k(x, k)[1].astype(jnp.int32),
    )


def _top_ids_by_passes(x: jax.Array, k: int) -> jax.Array:
    """`top_ids` by k passes over each row: take its largest key (the lowest index
    among equals), then set that entry's key below every value's.

    A loop, not k passes unrolled: for a v5e target XLA:TPU compiled the unrolled 20
    passes 10-43x longer (top_ids alone at [8, 1k], [8, 152k], [64, 32k]; 2 cores of
    a Zen 3 EPYC), and every sampling and prompt-logprobs program holds them."""
    index = jnp.arange(x.shape[1], dtype=jnp.int32)

    def one(i, carry):
        keys, ids = carry
        best = argmax(keys)
        return jnp.where(index == best[:, None], 0, keys), ids.at[:, i].set(best)

    ids = jnp.zeros((x.shape[0], k), jnp.int32)
    return lax.fori_loop(0, k, one, (_ordered_keys(x), ids))[1]


def no_logprobs(rows: int):
    """`token_logprobs`'s zeros, for the branch of a `lax.cond` that skips it."""
    return (
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows,), jnp.int32),
        jnp.zeros((rows, MAX_TOP_LOGPROBS), jnp.int32),
        jnp.zeros((rows, MAX_TOP_LOGPROBS), jnp.float32),
    )
