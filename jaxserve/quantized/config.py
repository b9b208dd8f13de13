"""Reading a Hugging Face config.json's `quantization_config`: AWQ, GPTQ,
compressed-tensors and fp8 checkpoints as users download them.

`read_quantization_config` gives a `QuantFormat`: the method, the codes' width and
groups, the tensors each quantized linear stores, and which linears are quantized. What
the engine cannot serve is refused at start-up, naming the field and its value. The
storage itself is `jaxserve.quantized.formats`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import re2

METHODS = ("awq", "gptq", "compressed-tensors-int", "fp8-block", "fp8-channel", "fp8-tensor")
_INT_METHODS = METHODS[:3]
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint stores its quantized linears (`read_quantization_config`).

    method: "awq", "gptq", "compressed-tensors-int" (integers packed in int32), or
      "fp8-block" / "fp8-channel" / "fp8-tensor" (e4m3 weights with a scale per block of
      `block_size`, per output channel, or one per tensor).
    quant_method: the config's own name ("awq", "gptq", "compressed-tensors", "fp8",
      "fbgemm_fp8").
    bits: the codes' width, 4 or 8 (8 for fp8).
    group_size: inputs per scale; None: one scale spans every input (channel-wise; fp8).
    symmetric: no zero points are stored, the zero is 2^(bits-1) (GPTQ stores them even
      so, all 2^(bits-1)).
    tensors: the names (after the module's name and a dot) each quantized linear
      stores; optional_tensors: those it may store (GPTQ's g_idx without desc_act).
    desc_act: inputs are grouped by a stored g_idx, not in order (GPTQ desc_act,
      compressed-tensors actorder "group").
    block_size: fp8-block's (output rows, input columns) per scale.
    zeros_minus_one: GPTQ v1 storage: each stored zero point is the zero minus one.
    targets, ignore: which linears are quantized (`is_quantized`), in compressed-tensors'
      terms, to which the other formats' lists are translated: "Linear" matches every
      linear, "re:<pattern>" a name the pattern matches from its start (RE2), any other
      entry that exact module name.
    activations: "fp8-dynamic" or "fp8-static" when the checkpoint also quantizes
      activations to fp8; the engine runs them in floating point (weight-only), as vLLM
      does on GPUs without fp8 arithmetic.
    """

    method: str
    quant_method: str
    bits: int
    group_size: int | None
    symmetric: bool
    tensors: tuple[str, ...]
    optional_tensors: tuple[str, ...] = ()
    desc_act: bool = False
    block_size: tuple[int, int] | None = None
    zeros_minus_one: bool = False
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    activations: str | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"QuantFormat.method {self.method!r}: not one of {METHODS}")
        if self.bits not in (4, 8) or (self.method not in _INT_METHODS and self.bits != 8):
            raise ValueError(f"QuantFormat: {self.bits} bits for {self.method!r}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"QuantFormat.group_size {self.group_size}: not a positive size")
        if (self.method == "fp8-block") != (self.block_size is not None):
            raise ValueError(f"QuantFormat: block_size {self.block_size} for {self.method!r}")
        _check_patterns("QuantFormat.targets", list(self.targets))
        _check_patterns("QuantFormat.ignore", list(self.ignore))

    def is_quantized(self, module: str) -> bool:
        """Whether the linear named `module` (e.g. "model.layers.0.mlp.down_proj") is
        stored quantized: a target matches it and no ignore entry does."""
        return any(_matches(module, t) for t in self.targets) and not any(
            _matches(module, entry) for entry in self.ignore
        )


def read_quantization_config(config: Mapping[str, Any]) -> QuantFormat | None:
    """The `QuantFormat` of a Hugging Face config.json (as a dict), None when it has no
    `quantization_config` (nor compressed-tensors' older `compression_config`).
    ValueError, naming the field and its value, for what the engine cannot serve: other
    methods (bitsandbytes, GGUF, ...), AWQ GEMV layouts, 2- and 3-bit codes, integer or
    fp4 activations, sparsity and transforms, per-module overrides."""
    key = "quantization_config" if "quantization_config" in config else "compression_config"
    qc = config.get(key)
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise _refuse(key, qc, "is not an object")
    method = qc.get("quant_method")
    if method not in _READERS:
        raise _refuse(f"{key}.quant_method", method, f"is not served (served: {sorted(_READERS)})")
    return _READERS[method](qc, key)


def _awq(qc: Mapping, path: str) -> QuantFormat:
    _choice(qc, path, "bits", 4, (4,), "is not served: AWQ checkpoints with 4-bit codes are")
    key = "version" if "version" in qc else "format"
    if str(qc.get(key, "gemm")).lower() != "gemm":
        why = "is not served: AWQ's GEMM layout ('gemm') is; GEMV layouts pack differently"
        raise _refuse(f"{path}.{key}", qc[key], why)
    _choice(qc, path, "zero_point", True, (True,), "is not served: AWQ GEMM stores zero points")
    ignore = _hf_ignore(_names(qc, path, "modules_to_not_convert"))
    tensors = ("qweight", "qzeros", "scales")
    return QuantFormat("awq", "awq", 4, _group_size(qc, path), False, tensors, ignore=ignore)


def _gptq(qc: Mapping, path: str) -> QuantFormat:
    bits = _choice(qc, path, "bits", None, (4, 8), "is not served: GPTQ with 4 or 8 bits is")
    key = "checkpoint_format" if "checkpoint_format" in qc else "format"
    why = "is not served: GPTQ's own storage ('gptq', 'gptq_v2') is, not a kernel's repacking"
    storage = _choice(qc, path, key, "gptq", ("gptq", "gptq_v2"), why)
    _choice(qc, path, "is_marlin_format", False, (False,), "is not served: Marlin repacks GPTQ")
    if qc.get("dynamic"):
        raise _refuse(f"{path}.dynamic", qc["dynamic"], "is not served: per-module overrides")
    desc_act = _choice(qc, path, "desc_act", False, (False, True), "is not a boolean")
    lm_head = _choice(qc, path, "lm_head", False, (False, True), "is not a boolean")
    targets = ("Linear",)
    blocks = qc.get("modules_in_block_to_quantize")
    if blocks:  # [[names quantized together], ...]: a block's other linears are not
        steps = [[s] if isinstance(s, str) else s for s in blocks]
        if not all(isinstance(s, list) and all(isinstance(n, str) for n in s) for s in steps):
            raise _refuse(f"{path}.modules_in_block_to_quantize", blocks, "is not lists of names")
        names = [n for step in steps for n in step]
        targets = ("re:(?:.*\\.)?(?:" + "|".join(map(re.escape, names)) + ")$",)
        targets += ("lm_head",) if lm_head else ()
    return QuantFormat(
        "gptq",
        "gptq",
        bits,
        _group_size(qc, path),
        symmetric=_choice(qc, path, "sym", True, (False, True), "is not a boolean"),
        tensors=("qweight", "qzeros", "scales") + (("g_idx",) if desc_act else ()),
        optional_tensors=() if desc_act else ("g_idx",),
        desc_act=desc_act,
        zeros_minus_one=storage == "gptq",
        targets=targets,
        ignore=() if lm_head else ("lm_head",),
    )


def _compressed_tensors(qc: Mapping, path: str) -> QuantFormat:
    """One weight scheme for the whole checkpoint (several groups may share it, each
    with its targets). kv_cache_scheme is not read: the engine's KV cache keeps its own
    dtype, and the checkpoint's k/v scales are left to the loader to skip."""
    why = "is not served: the weights must be stored compressed"
    _choice(qc, path, "quantization_status", "compressed", ("compressed",), why)
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _refuse(f"{path}.{key}", qc[key], "is not served")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse(f"{path}.config_groups", groups, "is not an object of schemes")
    schemes: dict[QuantFormat, str] = {}
    targets: list[str] = []
    for name, group in groups.items():
        gpath = f"{path}.config_groups.{name}"
        if not isinstance(group, Mapping):
            raise _refuse(gpath, group, "is not a scheme (an object of targets and weights)")
        schemes.setdefault(_ct_scheme(group, gpath, qc, path), gpath)
        group_targets = _names(group, gpath, "targets")
        _check_patterns(f"{gpath}.targets", group_targets)
        targets += group_targets
    if len(schemes) > 1:
        raise ValueError(
            f"{path}.config_groups: {len(schemes)} different weight schemes "
            f"({', '.join(schemes.values())}); checkpoints with one are served"
        )
    (scheme,) = schemes
    ignore = _names(qc, path, "ignore")
    _check_patterns(f"{path}.ignore", ignore)
    return dataclasses.replace(scheme, targets=tuple(targets), ignore=tuple(ignore))


def _ct_scheme(group: Mapping, gpath: str, qc: Mapping, path: str) -> QuantFormat:
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise _refuse(f"{gpath}.weights", weights, "is not served: weights must be quantized")
    wpath = f"{gpath}.weights"
    if group.get("output_activations") is not None:
        raise _refuse(f"{gpath}.output_activations", group["output_activations"], "is not served")
    activations = _ct_activations(group.get("input_activations"), f"{gpath}.input_activations")
    fmt_owner, fmt_path = (group, gpath) if group.get("format") else (qc, path)
    _choice(weights, wpath, "dynamic", False, (False,), "is not served for weights")
    symmetric = _choice(weights, wpath, "symmetric", True, (False, True), "is not a boolean")
    kind = _choice(weights, wpath, "type", "int", ("int", "float"), "is not served")
    if kind == "int":
        why = "is not served: integer weights packed in int32 ('pack-quantized') are"
        _choice(fmt_owner, fmt_path, "format", None, ("pack-quantized",), why)
        bits = _choice(weights, wpath, "num_bits", 8, (4, 8), "is not served: 4 or 8 bits are")
        why = "is not served for integer weights: 'group' and 'channel' are"
        strategy = _choice(weights, wpath, "strategy", None, ("group", "channel"), why)
        group_size = _group_size(weights, wpath) if strategy == "group" else None
        actorder = weights.get("actorder")
        desc_act = actorder in ("group", "dynamic") or actorder is True
        if not desc_act and actorder not in (None, False, "weight", "static"):
            raise _refuse(f"{wpath}.actorder", actorder, "is not served")
        tensors = ("weight_packed", "weight_scale", "weight_shape")
        tensors += (() if symmetric else ("weight_zero_point",)) + (
            ("weight_g_idx",) if desc_act else ()
        )
        method = "compressed-tensors-int"
        return QuantFormat(
            method, "compressed-tensors", bits, group_size, symmetric, tensors,
            desc_act=desc_act, activations=activations,
        )  # fmt: skip
    why = "is not served for float weights: fp8 (8) is, not fp4 (NVFP4, MXFP4)"
    _choice(weights, wpath, "num_bits", 8, (8,), why)
    why = "is not served for fp8 weights: 'float-quantized' and 'naive-quantized' are"
    _choice(fmt_owner, fmt_path, "format", None, ("float-quantized", "naive-quantized"), why)
    _choice(weights, wpath, "symmetric", True, (True,), "is not served for fp8 weights")
    why = "is not served for fp8 weights: 'tensor', 'channel' and 'block' are"
    strategy = _choice(weights, wpath, "strategy", None, ("tensor", "channel", "block"), why)
    block = None
    if strategy == "block":
        block = _block(weights.get("block_structure"), f"{wpath}.block_structure")
    tensors = ("weight", "weight_scale")
    return QuantFormat(
        f"fp8-{strategy}", "compressed-tensors", 8, None, True, tensors,
        block_size=block, activations=activations,
    )  # fmt: skip


def _ct_activations(args: Any, apath: str) -> str | None:
    if args is None:
        return None
    if not isinstance(args, Mapping):
        raise _refuse(apath, args, "is not an object")
    why = "is not served: activation quantization the engine cannot run (fp8 is run as float)"
    _choice(args, apath, "type", "int", ("float",), why)
    _choice(args, apath, "num_bits", 8, (8,), why)
    return "fp8-dynamic" if args.get("dynamic", False) else "fp8-static"


def _fp8(qc: Mapping, path: str) -> QuantFormat:
    """Hugging Face's fine-grained fp8 (DeepSeek-V3 style: weight_block_size and
    weight_scale_inv), or, without weight_block_size, a scale per tensor (AutoFP8 and
    vLLM's "fp8": weight_scale)."""
    scheme = _choice(qc, path, "activation_scheme", "dynamic", ("dynamic", "static"), "is unknown")
    _choice(qc, path, "fmt", "e4m3", ("e4m3", None), "is not served: e4m3 weights are")
    _choice(qc, path, "scale_fmt", "float", ("float", "ue8m0", None), "is not served")
    _choice(qc, path, "expert_dtype", "fp8", ("fp8", None), "is not served: fp8 experts are")
    if qc.get("modules_to_convert"):
        raise _refuse(f"{path}.modules_to_convert", qc["modules_to_convert"], "is not served")
    key = "modules_to_not_convert" if "modules_to_not_convert" in qc else "ignored_layers"
    common = dict(ignore=_hf_ignore(_names(qc, path, key)), activations=f"fp8-{scheme}")
    if qc.get("weight_block_size") is None:
        return QuantFormat("fp8-tensor", "fp8", 8, None, True, ("weight", "weight_scale"), **common)
    block = _block(qc["weight_block_size"], f"{path}.weight_block_size")
    tensors = ("weight", "weight_scale_inv")
    return QuantFormat("fp8-block", "fp8", 8, None, True, tensors, block_size=block, **common)


def _fbgemm_fp8(qc: Mapping, path: str) -> QuantFormat:
    ignore = _hf_ignore(_names(qc, path, "modules_to_not_convert"))
    return QuantFormat(
        "fp8-channel", "fbgemm_fp8", 8, None, True, ("weight", "weight_scale"),
        ignore=ignore, activations="fp8-dynamic",  # per token, run in floating point
    )  # fmt: skip


_READERS = {
    "awq": _awq,
    "gptq": _gptq,
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
    "fbgemm_fp8": _fbgemm_fp8,
}


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{field}: {value!r:.100} {why}")


def _choice(owner: Mapping, path: str, key: str, default: Any, allowed: tuple, why: str) -> Any:
    """owner[key] (default when absent), which must be one of `allowed` (by type and
    value: True is not 1)."""
    value = owner.get(key, default)
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise _refuse(f"{path}.{key}", value, why)
    return value


def _group_size(owner: Mapping, path: str) -> int | None:
    value = owner.get("group_size", 128)
    if type(value) is not int or (value < 1 and value != -1):
        raise _refuse(f"{path}.group_size", value, "is not a group size (> 0, or -1: per channel)")
    return None if value == -1 else value


def _block(value: Any, path: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2) or any(
        type(v) is not int or v < 1 for v in value
    ):
        raise _refuse(path, value, "is not a block size [output rows, input columns]")
    return tuple(value)


def _names(owner: Mapping, path: str, key: str) -> list[str]:
    value = owner.get(key) or []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise _refuse(f"{path}.{key}", value, "is not a list of module names")
    return list(value)


def _hf_ignore(names: list[str]) -> tuple[str, ...]:
    """Hugging Face's modules_to_not_convert as ignore entries: an entry matches a name
    of which it is a whole run of dotted parts ("mlp.gate" matches
    "model.layers.0.mlp.gate", not "mlp.gate_proj"); the LM head is never quantized."""
    return tuple(f"re:(?:.*\\.)?{re.escape(n)}(?:\\..*)?$" for n in names) + ("lm_head",)


def _check_patterns(path: str, entries: list[str]) -> None:
    for entry in entries:
        try:
            _pattern(entry)
        except re2.error as e:
            why = e.args[0] if e.args else ""
            why = why.decode(errors="replace") if isinstance(why, bytes) else str(why)
            raise _refuse(path, entry, f"is not a regular expression RE2 reads ({why})") from None


@functools.lru_cache(maxsize=1024)
def _pattern(entry: str):
    """The compiled pattern of a "re:" entry (RE2: linear time, whatever a checkpoint's
    config holds), else None."""
    return re2.compile(entry[3:], _RE2_OPTIONS) if entry.startswith("re:") else None


def _matches(name: str, entry: str) -> bool:
    pattern = _pattern(entry)
    if pattern is not None:
        return pattern.match(name) is not None
    return entry == "Linear" or entry == name
