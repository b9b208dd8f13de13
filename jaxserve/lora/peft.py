"""Reading a PEFT LoRA adapter (`adapter_config.json`, `adapter_model.safetensors`)
and checking it against the served model, before anything reaches the device.

What is served: LoRA (PEFT's `peft_type` "LORA") on the projections the model
exposes (`LoRALayout`: q/k/v/o and gate/up/down of every layer that has them as
linears), any subset of them, each module's rank up to `max_lora_rank`, scaled by
`lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`), with PEFT's
`rank_pattern` and `alpha_pattern` read per module as PEFT reads them. Everything
else an adapter can carry changes the computation in ways the engine does not
reproduce, so it is refused with a ValueError naming it: DoRA, trained biases,
`modules_to_save`, embedding or LM-head adapters, MoE expert weights, other
variants.

`base_model_name_or_path` is only compared by name, and a mismatch is logged, not
refused: a local directory and the hub name of the same model differ, and the
shapes (checked exactly, module by module) are what makes an adapter fit.

Host logic: numpy and json, no JAX (the tensors are read by a small safetensors
reader, which takes bfloat16 without JAX's dtypes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re

import numpy as np

from jaxserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Config fields that, when set, ask for something other than plain LoRA.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D base layers)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "layer_replication": "layer_replication",
    "target_parameters": "adapters on parameters (target_parameters: MoE expert weights)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "velora_config": "VeLoRA (velora_config)",
}
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
_LAYERS = re.compile(r"(?:^|\.)(layers\.\d+\..+)$")


def module_key(name: str) -> str | None:
    """A projection's name from its layer on ('layers.3.self_attn.q_proj'), the same for
    the model's paths and PEFT's module names whatever prefix each has; None outside
    the decoder layers (embeddings, LM head)."""
    m = _LAYERS.search(name)
    return m.group(1) if m else None


@dataclasses.dataclass(frozen=True)
class LoRALayout:
    """What a served model can adapt: each projection's (in, out) by `module_key`."""

    modules: dict[str, tuple[int, int]]
    max_rank: int


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """An adapter read and checked: its matrices per projection, (A [r, in] as PEFT
    stores it, B [r, out]: PEFT's transposed) float32, its scale folded into B. `key`
    is a digest of its files' contents: its identity on the device (slots) and in the
    prefix cache."""

    request: LoRARequest
    key: str
    rank: int  # the largest rank of its modules
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(request: LoRARequest, layout: LoRALayout, model_dir: str = "") -> Adapter:
    """Reads the adapter at `request.lora_path` and checks it against `layout`; raises
    ValueError naming the adapter and what does not match."""
    what = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config_bytes, weights_bytes = _read_files(request.lora_path, what)
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what}: {CONFIG_FILE} must hold a JSON object")
    rank, alpha = _check_config(config, what)
    _check_base_model(config.get("base_model_name_or_path"), model_dir, what)
    tensors = _parse_safetensors(weights_bytes, what)
    pairs = _pair_tensors(tensors, what)
    weights = {}
    for module, (a, b) in sorted(pairs.items()):
        key = _check_module(module, a, b, layout, what)
        r = a.shape[0]
        ranks = config.get("rank_pattern") or {}
        expected = ranks.get(_pattern_key(ranks, module), rank)
        if r != expected:
            raise ValueError(
                f"{what}: {module} has rank {r} in {WEIGHTS_FILE}, its config says {expected}"
            )
        patterns = config.get("alpha_pattern") or {}
        a_m = patterns.get(_pattern_key(patterns, module), alpha)
        scale = a_m / math.sqrt(r) if config.get("use_rslora") else a_m / r
        weights[key] = (np.ascontiguousarray(a), np.ascontiguousarray(b.T * np.float32(scale)))
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    digest.update(weights_bytes)
    return Adapter(
        request, digest.hexdigest(), max(a.shape[0] for a, _ in weights.values()), weights
    )


def _read_files(path: str, what: str) -> tuple[bytes, bytes]:
    if not os.path.isdir(path):
        raise ValueError(f"{what}: lora_path is not a directory")
    files = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            also = ""
            if name == WEIGHTS_FILE and os.path.isfile(os.path.join(path, "adapter_model.bin")):
                also = " (it has adapter_model.bin: pickled weights are not read; save the "
                also += "adapter with safe_serialization=True)"
            raise ValueError(f"{what}: no {name}{also}")
        with open(file, "rb") as f:
            files.append(f.read())
    return files[0], files[1]


def _check_config(config: dict, what: str) -> tuple[int, float]:
    """The config's default rank and alpha, once everything else in it is servable."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise ValueError(f"{what}: peft_type is {peft_type!r}; only 'LORA' adapters are served")
    for field, name in _REFUSED_FIELDS.items():
        if config.get(field):
            raise ValueError(f"{what}: {name} is not supported ({field}={config[field]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{what}: trained base biases (bias={config['bias']!r}) are not supported; "
            "bias must be 'none'"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"{what}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{what}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a regex string, or "all-linear": the tensors tell)
        bad = sorted(t for t in targets if t not in SUPPORTED_TARGETS)
        if bad:
            raise ValueError(
                f"{what}: target_modules {bad} are not supported; an adapter may target "
                f"any of {list(SUPPORTED_TARGETS)}"
            )
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(field) or {}, dict):
            raise ValueError(f"{what}: {field} must be an object, got {config[field]!r}")
    return rank, float(alpha)


def _check_base_model(base: object, model_dir: str, what: str) -> None:
    if not isinstance(base, str) or not base or not model_dir:
        return
    served = os.path.realpath(model_dir)
    if os.path.realpath(base) == served:
        return
    if os.path.basename(base.rstrip("/")).lower() != os.path.basename(served).lower():
        logger.warning(
            "%s was trained on %r, and this engine serves %r: served anyway (its shapes "
            "match the model's)",
            what,
            base,
            model_dir,
        )


def _pattern_key(patterns: dict, module: str) -> str:
    """PEFT's `get_pattern_key`: the first pattern that matches the module's name at a
    dot boundary (else the name itself, which no pattern has)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def _pair_tensors(tensors: dict[str, np.ndarray], what: str) -> dict[str, tuple]:
    """module name -> (lora_A [r, in], lora_B [out, r]), as PEFT stores them."""
    found: dict[str, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        m = _KEY.match(name)
        if m is None:
            raise ValueError(
                f"{what}: tensor {name!r} is not a LoRA A or B matrix (DoRA magnitudes, "
                "embedding adapters and trained biases are not supported)"
            )
        found.setdefault(m.group(1), {})[m.group(2)] = value
    if not found:
        raise ValueError(f"{what}: {WEIGHTS_FILE} holds no LoRA matrices")
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{what}: {module} has lora_{''.join(ab)} without its pair")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _check_module(module: str, a: np.ndarray, b: np.ndarray, layout: LoRALayout, what: str) -> str:
    """The module's `module_key` once its matrices fit the served model."""
    key = module_key(module)
    if key is None or key not in layout.modules:
        leaf = module.rsplit(".", 1)[-1]
        if ".experts." in f".{module}." or leaf == "experts":
            why = "an MoE expert weight: adapters on experts are not supported"
        elif leaf in ("lm_head", "embed_tokens"):
            why = "the embeddings or the LM head: adapters there are not supported"
        elif leaf in SUPPORTED_TARGETS:
            why = "a projection this model does not have"
        else:
            why = f"not one of the supported targets {list(SUPPORTED_TARGETS)}"
        raise ValueError(f"{what}: it adapts {module}, {why}")
    d_in, d_out = layout.modules[key]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"{what}: {module} has lora_A {a.shape} and lora_B {b.shape}, not [r, in] and [out, r]"
        )
    if a.shape[1] != d_in or b.shape[0] != d_out:
        raise ValueError(
            f"{what}: {module} maps {a.shape[1]} -> {b.shape[0]} features, the served "
            f"model's maps {d_in} -> {d_out} (an adapter of another base model?)"
        )
    if a.shape[0] > layout.max_rank:
        raise ValueError(
            f"{what}: {module} has rank {a.shape[0]}, over max_lora_rank={layout.max_rank}"
        )
    return key


# Just enough safetensors: an 8-byte header length, a JSON header, the raw tensors.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _parse_safetensors(data: bytes, what: str) -> dict[str, np.ndarray]:
    """The file's tensors as float32 arrays."""
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, not a float type")
            start, end = info["data_offsets"]
            raw = np.frombuffer(
                data, dtype, (end - start) // np.dtype(dtype).itemsize, 8 + size + start
            )
            if info["dtype"] == "BF16":  # the high half of a float32
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            tensors[name] = raw.astype(np.float32).reshape(info["shape"])
        return tensors
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}: cannot read {WEIGHTS_FILE}: {e}") from None
