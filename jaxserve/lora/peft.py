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

The files are untrusted input (a server loads the adapter a client names), so
reading them is bounded: `adapter_config.json` to `MAX_CONFIG_BYTES`, the weights to
`LoRALayout.max_weights_bytes` (the largest adapter the engine's slots could hold),
each checked by size before it is read; the safetensors header is checked field by
field; `rank_pattern` and `alpha_pattern` keys, which PEFT reads as regular
expressions, are matched by RE2 (linear time) rather than by Python's backtracking
`re`. Whatever is wrong is a ValueError naming the adapter and the file.

Host logic: numpy and json, no JAX (the tensors are read by a small safetensors
reader, which takes bfloat16 without JAX's dtypes). Any thread may read an adapter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable

import numpy as np
import re2

from jaxserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json is a few kB; with a rank_pattern entry per module of an 80-layer
# model, tens of kB.
MAX_CONFIG_BYTES = 1 << 20
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

    @property
    def max_weights_bytes(self) -> int:
        """The largest `adapter_model.safetensors` that can hold an adapter the slots take:
        every module at `max_rank` in float64 (the widest dtype read), plus 1 KiB of
        header per module (two tensors' names, dtypes, shapes, offsets) and 1 MiB for
        the rest of the header (PEFT's metadata). A larger file is refused unread."""
        per_module = sum(
            8 * self.max_rank * (d_in + d_out) for d_in, d_out in self.modules.values()
        )
        return per_module + 1024 * len(self.modules) + (1 << 20)


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
    config_bytes, weights_bytes = _read_files(request.lora_path, layout, what)
    try:
        config = json.loads(config_bytes)
    except (ValueError, RecursionError) as e:  # (not JSON, not UTF-8, nested too deep)
        raise ValueError(f"{what}: {CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what}: {CONFIG_FILE} must hold a JSON object")
    rank, alpha = _check_config(config, what)
    ranks = _patterns(config, "rank_pattern", what)
    alphas = _patterns(config, "alpha_pattern", what)
    _check_base_model(config.get("base_model_name_or_path"), model_dir, what)
    tensors = _parse_safetensors(weights_bytes, what)
    pairs = _pair_tensors(tensors, what)
    weights = {}
    for module, (a, b) in sorted(pairs.items()):
        key = _check_module(module, a, b, layout, what)
        r = a.shape[0]
        expected = _pattern_value(ranks, module, rank)
        if r != expected:
            raise ValueError(
                f"{what}: {module} has rank {r} in {WEIGHTS_FILE}, its config says {expected}"
            )
        a_m = _pattern_value(alphas, module, alpha)
        scale = a_m / math.sqrt(r) if config.get("use_rslora") else a_m / r
        weights[key] = (np.ascontiguousarray(a), np.ascontiguousarray(b.T * np.float32(scale)))
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    digest.update(weights_bytes)
    return Adapter(
        request, digest.hexdigest(), max(a.shape[0] for a, _ in weights.values()), weights
    )


def _read_files(path: str, layout: LoRALayout, what: str) -> tuple[bytes, bytes]:
    """The config's and the weights' bytes, each file's size checked before it is read."""
    if not os.path.isdir(path):
        raise ValueError(f"{what}: lora_path is not a directory")
    files = []
    for name, bound in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, layout.max_weights_bytes)):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            also = ""
            if name == WEIGHTS_FILE and os.path.isfile(os.path.join(path, "adapter_model.bin")):
                also = " (it has adapter_model.bin: pickled weights are not read; save the "
                also += "adapter with safe_serialization=True)"
            raise ValueError(f"{what}: no {name}{also}")
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(bound + 1) if size <= bound else b""
        if size > bound or len(data) > bound:  # (or it grew since its size was read)
            why = "MAX_CONFIG_BYTES"
            if name == WEIGHTS_FILE:
                why = "every module the served model has, at max_lora_rank, in float64"
            raise ValueError(
                f"{what}: {name} has {max(size, len(data))} bytes, more than the {bound} "
                f"an adapter's {name} may have ({why})"
            )
        files.append(data)
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
        bad = sorted((t for t in targets if t not in SUPPORTED_TARGETS), key=str)
        if bad:
            raise ValueError(
                f"{what}: target_modules {bad} are not supported; an adapter may target "
                f"any of {list(SUPPORTED_TARGETS)}"
            )
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


# RE2 reports a pattern it refuses by raising; its log line would only repeat that.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


def _patterns(config: dict, field: str, what: str) -> list[tuple[object, float]]:
    r"""`rank_pattern` or `alpha_pattern` as (compiled key, value), in the config's order.
    PEFT matches each key as a regular expression against the module's name
    (`get_pattern_key`: `re.match(rf"(.*\.)?({key})$", name)`); RE2 matches the same
    patterns in time linear in the name, where Python's backtracking `re` can take
    exponential time on a crafted key (`(\w*)*!`). A key RE2 does not read (a
    backreference, a lookaround, one too large) is refused by name."""
    patterns = config.get(field) or {}
    if not isinstance(patterns, dict):
        raise ValueError(f"{what}: {field} must be an object, got {patterns!r:.100}")
    compiled = []
    for key, value in patterns.items():
        if field == "rank_pattern":
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            kind = "a positive integer" if field == "rank_pattern" else "a number"
            raise ValueError(f"{what}: {field}[{key!r:.100}] must be {kind}, got {value!r:.100}")
        try:
            pattern = re2.compile(rf"(.*\.)?({key})$", _RE2_OPTIONS)
        except re2.error as e:
            why = e.args[0] if e.args else ""
            why = why.decode(errors="replace") if isinstance(why, bytes) else str(why)
            raise ValueError(
                f"{what}: {field} key {key!r:.100} is not a regular expression RE2 reads ({why}); "
                "a key is a module name, or a pattern of names without backreferences or "
                "lookarounds"
            ) from None
        compiled.append((pattern, value))
    return compiled


def _pattern_value(patterns: list[tuple[object, float]], module: str, default):
    """The value of the first pattern that matches the module's name (`_patterns`), else
    `default`."""
    for pattern, value in patterns:
        if pattern.match(module):
            return value
    return default


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
    """The file's tensors as float32 arrays; ValueError naming the file and what in it is
    malformed (the header is read as untrusted: every field checked before use)."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{what}: cannot read {WEIGHTS_FILE}: {why}")

    if len(data) < 8:
        raise bad(f"it has {len(data)} bytes, fewer than the 8 of its header's length")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise bad(f"its header length {size} runs past the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad(f"its header is not UTF-8 ({e})") from None
    except (ValueError, RecursionError) as e:  # (JSONDecodeError; nested too deep)
        raise bad(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object")
    start_of_data, data_bytes = 8 + size, len(data) - 8 - size
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = _tensor_info(name, info, data_bytes, bad)
        raw = np.frombuffer(data, dtype, (end - start) // dtype.itemsize, start_of_data + start)
        if info["dtype"] == "BF16":  # the high half of a float32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = raw.astype(np.float32).reshape(shape)
    return tensors


def _tensor_info(
    name: str, info: object, data_bytes: int, bad: Callable[[str], ValueError]
) -> tuple:
    """A header entry's (dtype, shape, data_offsets), once they describe bytes the file
    holds: a float dtype, a shape of at most 32 non-negative integers whose size fills
    its offsets exactly, offsets within the `data_bytes` after the header. (The values
    quoted in an error are cut short: the file's author chose them.)"""
    name = f"{name!r:.100}"
    if not isinstance(info, dict):
        raise bad(f"tensor {name} is described by {info!r:.100}, not an object")
    if not isinstance(info.get("dtype"), str) or info["dtype"] not in _DTYPES:
        raise bad(f"tensor {name} has dtype {info.get('dtype')!r:.100}, not one of {list(_DTYPES)}")
    dtype = np.dtype(_DTYPES[info["dtype"]])
    shape, offsets = info.get("shape"), info.get("data_offsets")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(shape, list) or len(shape) > 32 or not all(is_int(d) for d in shape):
        raise bad(
            f"tensor {name} has shape {shape!r:.100}, not a list of at most 32 non-negative "
            "integers"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets):
        raise bad(f"tensor {name} has data_offsets {offsets!r:.100}, not [start, end]")
    start, end = offsets
    if not start <= end <= data_bytes:
        raise bad(
            f"tensor {name} has data_offsets {offsets}, outside the {data_bytes} bytes of "
            "tensor data"
        )
    if math.prod(shape) * dtype.itemsize != end - start:
        raise bad(
            f"tensor {name} of shape {shape} in {info['dtype']} needs "
            f"{math.prod(shape) * dtype.itemsize} bytes, its data_offsets {offsets} span "
            f"{end - start}"
        )
    return dtype, shape, (start, end)
