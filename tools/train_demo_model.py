"""Trains jaxserve's embedded demo models from scratch, reproducibly, on 2 CPU cores.

  pip install -e ".[train]"
  python tools/train_demo_model.py --out_dir=jaxserve/assets

With the default step counts this takes about 30 minutes on 2 idle CPU cores.

The corpus is English prose that ships with every CPython: the docstrings and
comments of the standard library's own modules and the language reference
topics in `pydoc_data` (Python Software Foundation License, a permissive
license). Files are read in sorted order and documents are split into train and
validation by a hash of their text, so the same Python version gives the same
corpus; its SHA-256 is recorded in the report.

The script trains a byte-level BPE tokenizer with `tokenizers`, then two
Llama-architecture models with jaxserve's own model definition (`models.llama`):
`demo-model` (the default for `LLM()`, `jaxserve generate`, `jaxserve serve`)
and `demo-model-tiny`, a much smaller sibling on the same tokenizer (a draft
model for speculative decoding). Each is written as a Hugging Face model
directory with a `training_report.json` (losses, perplexities, corpus, time).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import sys
import sysconfig
import time
import tokenize

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from jaxserve.checkpoint import save_weights
from models import get_model_class
from models.config import ModelConfig
from pallas_kernels import AttentionBackend

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "jaxserve/assets", "Where the model directories go.")
flags.DEFINE_float("steps_scale", 1.0, "Multiplies each model's step count (quick trials).")
flags.DEFINE_integer("seed", 0, "Seed for data order and initialisation.")
flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary size.")
flags.DEFINE_integer("seq_len", 128, "Training sequence length.")
flags.DEFINE_integer("batch_size", 32, "Sequences per step.")

SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "__pycache__",
    "turtledemo",
    "ensurepip",
    "pydoc_data",
    "tkinter",
    "config-3.11-x86_64-linux-gnu",
}
EOT = "<|endoftext|>"
SPECIAL_TOKENS = [EOT, "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    learning_rate: float
    steps: int


SPECS = (
    ModelSpec("demo-model", 256, 4, 8, 4, 768, 3e-3, steps=900),
    ModelSpec("demo-model-tiny", 128, 2, 4, 2, 384, 4e-3, steps=1200),
)


# ----------------------------------------------------------------------------- corpus


def _comments(source: str) -> list[str]:
    """Runs of whole-line comments joined into paragraphs (licence headers and code skipped)."""
    paragraphs, run = [], []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
    last_line = -2
    for tok in tokens:
        if tok.type != tokenize.COMMENT or tok.line.strip() != tok.string.strip():
            continue
        text = tok.string.lstrip("#").strip()
        if tok.start[0] != last_line + 1 and run:
            paragraphs.append(" ".join(run))
            run = []
        if text and text[0].isalpha():
            run.append(text)
        last_line = tok.start[0]
    if run:
        paragraphs.append(" ".join(run))
    return [p for p in paragraphs if len(p) > 60 and "copyright" not in p.lower()]


def _prose(doc: str) -> str:
    """A docstring without its doctest examples."""
    return "\n".join(
        line for line in doc.splitlines() if not line.lstrip().startswith((">>>", "..."))
    )


def build_corpus() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    docs: list[str] = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    source = f.read()
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(
                    node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
                ):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 40:
                        docs.append(_prose(doc))
            docs.extend(_comments(source))
    from pydoc_data.topics import topics

    docs.extend(topics[k] for k in sorted(topics))
    return docs


def split(docs: list[str], val_fraction: float = 0.02) -> tuple[list[str], list[str]]:
    def bucket(d: str) -> float:
        return int(hashlib.sha256(d.encode()).hexdigest()[:8], 16) / 16**8

    return (
        [d for d in docs if bucket(d) >= val_fraction],
        [d for d in docs if bucket(d) < val_fraction],
    )


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def save_tokenizer(tok, model_dir: str) -> None:
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "pad_token": EOT,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def encode(tok, docs: list[str]) -> np.ndarray:
    """One stream: each document followed by the end-of-text token."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, np.int32)


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class CausalTrainingAttention(AttentionBackend):
    """Dense causal attention over [B, L] training sequences; no KV cache."""

    seq_len: int = 0

    def __call__(
        self, queries, keys, values, kv_cache, md, *, sm_scale, sliding_window=None, soft_cap=None
    ):
        del md, sliding_window, soft_cap
        t, n, h = queries.shape
        b, length, k = t // self.seq_len, self.seq_len, keys.shape[1]
        q = queries.reshape(b, length, k, n // k, h)
        kk = keys.reshape(b, length, k, h)
        vv = values.reshape(b, length, k, h)
        s = jnp.einsum("blkgh,bmkh->bkglm", q, kk) * sm_scale
        mask = jnp.tril(jnp.ones((length, length), bool))
        s = jnp.where(mask, s, -jnp.inf)
        out = jnp.einsum("bkglm,bmkh->blkgh", jax.nn.softmax(s, axis=-1), vv)
        return out.reshape(t, n, h), kv_cache


def hf_config(spec: ModelSpec, vocab_size: int, eot: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }


def _loss(model, tokens, seq_len):
    """Mean next-token cross-entropy over [B, L + 1] token windows."""
    b = tokens.shape[0]
    inputs, targets = tokens[:, :-1].reshape(-1), tokens[:, 1:].reshape(-1)
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), b)
    hidden, _ = model([None] * model.config.num_layers, inputs, positions, None)
    logits = model.compute_logits(hidden)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@functools.partial(nnx.jit, static_argnums=3)
def train_step(model, optimizer, tokens, seq_len):
    loss, grads = nnx.value_and_grad(_loss)(model, tokens, seq_len)
    optimizer.update(model, grads)
    return loss


@functools.partial(nnx.jit, static_argnums=2)
def eval_loss(model, tokens, seq_len):
    return _loss(model, tokens, seq_len)


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    n = (len(stream) - 1) // seq_len
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


def train(spec: ModelSpec, config: ModelConfig, train_ids, val_ids, total_steps: int, seed: int):
    seq_len, batch = FLAGS.seq_len, FLAGS.batch_size
    backend = CausalTrainingAttention("training", None, None, seq_len=seq_len)
    model = get_model_class(config.architecture)(
        config, dtype=jnp.float32, attention_backend=backend, rngs=nnx.Rngs(seed)
    )
    rs = np.random.RandomState(seed)
    max_start = len(train_ids) - seq_len - 1

    def sample():
        starts = rs.randint(0, max_start, size=batch)
        return np.stack([train_ids[s : s + seq_len + 1] for s in starts])

    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        spec.learning_rate,
        warmup_steps=(warmup := max(1, min(200, total_steps // 10))),
        decay_steps=max(total_steps, warmup + 1),
        end_value=spec.learning_rate * 0.05,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=0.05)
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    val = windows(val_ids, seq_len)
    print(f"{spec.name}: {total_steps} steps of {batch}x{seq_len} tokens", flush=True)
    from tqdm import tqdm

    history = []
    start = time.perf_counter()
    bar = tqdm(range(total_steps), desc=spec.name, mininterval=5)
    for step in bar:
        loss = train_step(model, optimizer, sample(), seq_len)
        if step % 100 == 0 or step == total_steps - 1:
            loss = float(loss)
            history.append((step, loss))
            bar.set_postfix(loss=f"{loss:.3f}")
    elapsed = time.perf_counter() - start

    def mean_loss(data):
        losses = [
            float(eval_loss(model, data[i : i + batch], seq_len))
            for i in range(0, len(data) - batch + 1, batch)
        ]
        return float(np.mean(losses))

    train_eval = windows(train_ids[: len(val_ids)], seq_len)
    report = {
        "steps": total_steps,
        "batch_size": batch,
        "seq_len": seq_len,
        "tokens_seen": total_steps * batch * seq_len,
        "train_seconds": round(elapsed, 1),
        "train_loss": round(mean_loss(train_eval), 4),
        "val_loss": round(mean_loss(val), 4),
        "loss_history": history[:: max(1, len(history) // 20)],
    }
    report["train_perplexity"] = round(math.exp(report["train_loss"]), 2)
    report["val_perplexity"] = round(math.exp(report["val_loss"]), 2)
    return model, report


def main(argv) -> None:
    del argv
    t0 = time.perf_counter()
    docs = build_corpus()
    corpus_sha = hashlib.sha256("\x00".join(docs).encode()).hexdigest()
    train_docs, val_docs = split(docs)
    tok = train_tokenizer(train_docs, FLAGS.vocab_size)
    train_ids, val_ids = encode(tok, train_docs), encode(tok, val_docs)
    print(
        f"corpus: {len(docs)} documents, {sum(map(len, docs)):,} characters, "
        f"{len(train_ids):,} train / {len(val_ids):,} validation tokens "
        f"(sha256 {corpus_sha[:12]}); tokenizer in {time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    eot = tok.token_to_id(EOT)
    for spec in SPECS:
        hf = hf_config(spec, tok.get_vocab_size(), eot)
        config = ModelConfig.from_hf(hf)
        steps = max(1, round(spec.steps * FLAGS.steps_scale))
        model, report = train(spec, config, train_ids, val_ids, steps, FLAGS.seed)
        out = os.path.join(FLAGS.out_dir, spec.name)
        os.makedirs(out, exist_ok=True)
        save_weights(model, out)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": eot, "eos_token_id": eot, "do_sample": False}, f, indent=2)
        save_tokenizer(tok, out)
        params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        report.update(
            parameters=int(params),
            python=sys.version.split()[0],
            seed=FLAGS.seed,
            corpus={
                "source": "CPython standard library docstrings and comments, pydoc_data topics",
                "license": "PSF-2.0",
                "documents": len(docs),
                "train_tokens": len(train_ids),
                "val_tokens": len(val_ids),
                "sha256": corpus_sha,
            },
            command="python tools/train_demo_model.py "
            + " ".join(
                f"--{k}={FLAGS[k].value}"
                for k in ("steps_scale", "seed", "vocab_size", "seq_len", "batch_size")
            ),
        )
        with open(os.path.join(out, "training_report.json"), "w") as f:
            json.dump(report, f, indent=2)
        print(
            json.dumps({k: v for k, v in report.items() if k != "loss_history"}, indent=1),
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
