"""PEFT LoRA adapters over the test checkpoints (torch + transformers + peft, test-only)."""

from __future__ import annotations

import copy
import json
import os
from unittest import mock

import numpy as np
import torch
import transformers
from engine_utils import SMALL_LLM
from hf_models import check_like_reference, hf_greedy
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from jaxserve import LLM, LoRARequest, SamplingParams

# Three adapters of different ranks and targets (the engine's max_lora_rank is 8):
# attention only; every projection with rsLoRA; the MLP with a per-module rank and
# alpha (PEFT's rank_pattern and alpha_pattern).
ADAPTERS = {
    "attn_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all_r8_rslora": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        + ["gate_proj", "up_proj", "down_proj"],
    ),
    "mlp_r2_patterns": dict(
        r=2,
        lora_alpha=4,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 6},
        alpha_pattern={"up_proj": 10},
    ),
}


def base_model(path: str):
    """The checkpoint at `path` as transformers loads it (float32, eager attention)."""
    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    kw = dict(attn_implementation="eager") if arch.startswith("Gemma") else {}
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32, **kw).eval()


def make_adapter(
    base_dir: str, out_dir: str, *, seed: int, scale: float = 0.3, **lora
) -> PeftModel:
    """A PEFT LoRA adapter on the checkpoint at `base_dir`, saved to `out_dir`: its A
    as PEFT initializes it, its B random (PEFT's zeros would change nothing), so that
    it moves the logits visibly. Returns the PEFT model (eval), for comparisons."""
    torch.manual_seed(seed)
    return peft_adapter(base_model(base_dir), out_dir, scale=scale, **lora)


def peft_adapter(base, out_dir: str, *, scale: float = 0.3, **lora) -> PeftModel:
    """`make_adapter` over the transformers model `base` (which PEFT wraps in place):
    saved to `out_dir`, returned in eval mode. Seed torch before."""
    # Mixtral's MLP is all experts (no gate/up/down linears): its MLP adapters adapt
    # o_proj instead.
    names = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    targets = [t for t in lora["target_modules"] if t in names]
    if not targets:
        lora, targets = dict(lora, rank_pattern={}, alpha_pattern={}), ["o_proj"]
    # PEFT on transformers 5 maps "gate_proj" of an MoE model onto its fused experts
    # (target_parameters: a shim for adapters trained on transformers 4's per-expert
    # linears), which the engine refuses. Without the shim PEFT adapts the linears
    # named so: the dense layers' MLPs and the shared experts.
    with mock.patch(
        "peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers",
        lambda *args, **kw: None,
    ):
        model = get_peft_model(base, LoraConfig(**{**lora, "target_modules": targets}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model.eval()


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """log_softmax of the logits [len(ids), V] of one sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def check_greedy(model, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
    """Our greedy `tokens` and their `logprobs` against `model` teacher-forced on them:
    each token is the model's top one (up to a float32 tie) and each logprob is the
    model's within float32 tolerance."""
    lp = hf_logprobs(model, prompt + tokens)[len(prompt) - 1 : -1]
    for j, (token, ours) in enumerate(zip(tokens, logprobs, strict=True)):
        top = lp[j].max()
        assert lp[j, token] >= top - 1e-4, (
            f"token {j}: ours {token} (HF logprob {lp[j, token]:.5f}), HF's top "
            f"{lp[j].argmax()} ({top:.5f})"
        )
        np.testing.assert_allclose(ours, lp[j, token], atol=2e-4, err_msg=f"logprob of token {j}")


def check_adapter_over_quantized(
    path: str, base, prompts, max_tokens: int, out_dir, case: str, **kw
) -> None:
    """QLoRA-style serving: a PEFT adapter (ADAPTERS' "all_r8_rslora", every projection)
    over the quantized model at `path` serves as PEFT over `base`, the transformers
    model holding the quantized weights dequantized: the same greedy tokens, first-step
    logprobs within 2e-2; requests without the adapter, in the same batches, serve as
    `base` alone. `kw`: more `LLM` arguments."""
    torch.manual_seed(7)
    adapter = os.path.join(str(out_dir), "adapter")
    peft = peft_adapter(copy.deepcopy(base), adapter, **ADAPTERS["all_r8_rslora"])
    want = [hf_greedy(peft, None, p, max_tokens) for p in prompts]
    with peft.disable_adapter():
        plain = [hf_greedy(peft, None, p, max_tokens) for p in prompts]
    assert [t for t, _ in want] != [t for t, _ in plain]  # (the adapter moves the tokens)
    llm = LLM(
        path, skip_tokenizer_init=True, enable_lora=True, max_loras=1, max_lora_rank=8,
        **{**SMALL_LLM, **kw},
    )  # fmt: skip
    lora = LoRARequest("qlora", 1, adapter)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    n = len(prompts)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts * 2],
        params,
        lora_request=[lora] * n + [None] * n,
        use_tqdm=False,
    )
    check_like_reference(outs[:n], want, f"{case} with the adapter")
    check_like_reference(outs[n:], plain, case)
    llm.close()
