"""On-policy RL with jaxserve in one JAX process: rollouts, a policy-gradient step
with optax, and the new weights handed back to the engine, every iteration.

The task is one a reader can check by eye: the policy is rewarded for completions
that contain a given word (by default "this", which the embedded demo model writes
in about one completion of eight before training). Each iteration

1. samples `--samples` completions of each prompt with the engine (temperature 1);
2. scores them (1 if the word is in the completion, else 0) and takes each
   completion's advantage as its reward minus its prompt group's mean, over the
   group's standard deviation (GRPO's normalization; REINFORCE with a baseline);
3. takes one Adam step on -advantage x log p(completion) under the current policy,
   computed by `jaxserve.training.Policy` (the engine's own model definition with
   a dense, differentiable attention);
4. hands the new weights to the engine: `LLM.update_weights(state)`. The arrays
   already live on the engine's devices with its shardings, so nothing is copied
   and no step program is compiled again.

It prints, per iteration, the mean reward, the update's time, the engine's
compilations (zero after the first iteration) and the bytes of live JAX arrays
(flat: old weights are freed as new ones arrive).

    python examples/rl_loop.py --iterations 20
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from jaxserve import LLM, SamplingParams
from jaxserve.training import Policy

PROMPTS = (
    "Once upon a time",
    "The weather today",
    "My favourite food is",
    "In the city",
    "She said that",
    "The old man",
    "We went to the",
    "After school",
)


@dataclasses.dataclass(frozen=True)
class Iteration:
    """What one iteration of the loop measured."""

    reward: float  # mean reward of this iteration's rollouts
    rollout_s: float  # generating them
    train_s: float  # the gradient step
    update_s: float  # `LLM.update_weights`
    tokens: int  # completion tokens generated
    compiles: int  # the engine's compilations during the iteration
    live_bytes: int  # bytes of every live JAX array after it


def _batch(prompt_ids, outputs, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Every completion after its prompt, right-padded to `length` tokens [B, L], and
    the mask of the positions whose next token is a completion token [B, L - 1]."""
    rows = [
        (p, c.token_ids) for p, out in zip(prompt_ids, outputs, strict=True) for c in out.outputs
    ]
    tokens = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length - 1), np.float32)
    for i, (prompt, completion) in enumerate(rows):
        ids = [*prompt, *completion][:length]
        tokens[i, : len(ids)] = ids
        mask[i, len(prompt) - 1 : len(ids) - 1] = 1.0
    return tokens, mask


def _advantages(rewards: np.ndarray) -> np.ndarray:
    """[prompts, samples] -> each reward against its group's mean, in its std."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    return centred / (rewards.std(axis=1, keepdims=True) + 1e-6)


def run(
    llm: LLM,
    *,
    iterations: int,
    word: str = "this",
    prompts: Sequence[str] = PROMPTS,
    samples: int = 8,
    max_tokens: int = 24,
    learning_rate: float = 3e-4,
    log=print,
) -> list[Iteration]:
    """The loop on `llm`'s model; returns each iteration's measurements."""
    policy = Policy.of(llm)
    state = Policy.state_of(llm)
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(state)
    pattern = re.compile(rf"\b{re.escape(word)}\b", re.IGNORECASE)
    prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
    length = max(len(p) for p in prompt_ids) + max_tokens

    @jax.jit
    def train_step(state, opt_state, tokens, mask, advantages):
        def loss_fn(state):
            logprobs = policy.logprobs(state, tokens)  # [B, L - 1]
            return -jnp.sum(advantages[:, None] * logprobs * mask) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(state)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    compiles = llm.engine.runner.compiles
    history = []
    for it in range(iterations):
        before = compiles.count
        t0 = time.perf_counter()
        # No per-request seed: one seed would give every prompt the same noise (the
        # engine's generator, seeded by `LLM(seed=...)`, keeps the run reproducible).
        params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
        )
        t1 = time.perf_counter()
        rewards = np.array(
            [[float(bool(pattern.search(c.text))) for c in out.outputs] for out in outputs]
        )
        tokens, mask = _batch(prompt_ids, outputs, length)
        adv = _advantages(rewards).reshape(-1).astype(np.float32)
        state, opt_state, loss = train_step(state, opt_state, tokens, mask, adv)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        llm.update_weights(state)
        t3 = time.perf_counter()
        del outputs
        live = sum(x.nbytes for x in jax.live_arrays())
        step = Iteration(
            reward=float(rewards.mean()),
            rollout_s=t1 - t0,
            train_s=t2 - t1,
            update_s=t3 - t2,
            tokens=int(mask.sum()),
            compiles=compiles.count - before,
            live_bytes=live,
        )
        history.append(step)
        log(
            f"iteration {it:3d}: reward {step.reward:.3f}  loss {float(loss):+.4f}  "
            f"rollouts {step.tokens / step.rollout_s:7.0f} tok/s  update "
            f"{step.update_s * 1e3:6.2f} ms  compiles {step.compiles}  "
            f"live arrays {live / 2**20:.1f} MiB"
        )
    return history


def main(argv: Sequence[str]) -> None:
    del argv
    f = flags.FLAGS
    with LLM(f.model, max_num_seqs=64, kv_cache_memory_bytes=1 << 27) as llm:
        history = run(
            llm,
            iterations=f.iterations,
            word=f.word,
            samples=f.samples,
            max_tokens=f.max_tokens,
            learning_rate=f.learning_rate,
        )
    first, last = history[0], history[-1]
    print(
        f"reward {first.reward:.3f} -> {last.reward:.3f}; compilations after the first "
        f"iteration: {sum(h.compiles for h in history[1:])}; live arrays "
        f"{history[0].live_bytes / 2**20:.1f} -> {last.live_bytes / 2**20:.1f} MiB"
    )


def _define_flags() -> None:
    """The command line's flags (defined only when run as a script: a process that
    imports `run`, a test, may define flags of these names itself)."""
    flags.DEFINE_integer("iterations", 20, "policy-gradient iterations")
    flags.DEFINE_string("word", "this", "the word a completion is rewarded for containing")
    flags.DEFINE_integer("samples", 8, "completions per prompt (the group size)")
    flags.DEFINE_integer("max_tokens", 24, "tokens per completion")
    flags.DEFINE_float("learning_rate", 3e-4, "Adam's learning rate")
    flags.DEFINE_string("model", None, "model directory (default: the demo model)")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
