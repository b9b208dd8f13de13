"""Bundles: an engine's compiled programs on disk, loaded at start-up instead of compiled.

A bundle is a directory: `manifest.json` and one file per program (every program
warm-up compiles: a forward per token bucket, sampling per row bucket with and
without the penalty history, the draft model's, the KV pages' gather/scatter).
Each file is `jax.experimental.serialize_executable.serialize`'s executable with
its argument and result trees, pickled.

The manifest records what the programs depend on: the target (platform, device
kind, device count; on the CPU its instruction-set extensions and whether the C++
kernels were called), the jax/jaxlib versions, a hash of the engine's code, and the
engine configuration that shapes the programs. A bundle whose manifest differs
from the loading engine's in any of these is refused before anything is loaded,
with a ValueError naming each field, the bundle's value and this engine's.

Loaded programs are called by `ByShape`: the executable compiled for the call's
argument shapes (its bucket), the way `jax.jit` picks from its cache, except that
a shape without a program raises instead of compiling.

Unpickling runs code, and so does a native program: a bundle is code. So it is
loaded only from where no other user could have written it, with the checks of the
CPU kernels' cache (`pallas_kernels.cpu.cache`, `private=False`): its directory this
user's or root's and unwritable by others, under ancestors no other user can
rename it in; each file a regular file of this user or root that no one else may
write, checked on the descriptor it is then read from; a program file named in
the manifest a plain name in the bundle. Anything else is refused, naming the file
and why, before a byte of it is unpickled. Load only bundles you made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pickle
import re
from collections.abc import Callable, Sequence

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

import jaxserve
from jaxserve import compile_records
from jaxserve.config import EngineConfig
from jaxserve.runner.step import StepPrograms
from pallas_kernels.cpu import cache as trust
from pallas_kernels.cpu import features as cpu_features

FORMAT = 3  # 2: the step programs take packed batches (runner.packing); 3: page tables kept
MANIFEST = "manifest.json"

# ----------------------------------------------------------------- manifest


def manifest(
    config: EngineConfig,
    *,
    device: jax.Device,
    num_devices: int,
    num_pages: int,
    token_buckets: Sequence[int],
    row_buckets: Sequence[int],
    weights: list,
    kv_transfer: bool,
    cpu_kernels: bool,
    kv_groups: Sequence[tuple[int | None, int]] = (),
) -> dict:
    """What an engine's programs depend on (JSON-ready), for `check` to compare.

    `device`: one of the devices the programs run on (or are compiled for);
    `weights`: the target model's (arrays or shapes); `kv_transfer`: whether the KV
    pages' gather/scatter programs are part of it (a KV tier); `kv_groups`: a hybrid
    KV cache's (window, pages) per layer group (its caches' shapes)."""
    target = {"platform": device.platform, "device_kind": device.device_kind}
    target["num_devices"] = num_devices
    if device.platform == "cpu":  # XLA:CPU compiles for this machine's CPU
        target["cpu_features"] = cpu_features.isa_features()
        target["cpu_kernels"] = cpu_kernels
    spec = config.speculative
    engine = {
        "model": dataclasses.asdict(config.model),
        "dtype": config.dtype,
        "kv_cache_dtype": config.kv_dtype,
        "quantization": config.quantization,
        "attention_backend": config.attention_backend,
        "block_size": config.cache.page_size,
        "num_kv_pages": num_pages,
        "max_model_len": config.max_model_len,
        "pages_per_seq": config.pages_per_seq,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "min_token_bucket": config.min_token_bucket,
        "max_logit_bias": config.max_logit_bias,
        "logprobs_mode": config.logprobs_mode,
        "sampling_branches": config.sampling_branches,  # (which sampling programs)
        "token_buckets": list(token_buckets),
        "row_buckets": list(row_buckets),
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "speculative": None
        if spec is None
        else {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "disable_by_batch_size": spec.disable_by_batch_size,
            "draft_model": dataclasses.asdict(spec.draft) if spec.draft else None,
        },
        "kv_transfer": kv_transfer,
        "lora": dataclasses.asdict(config.lora) if config.lora.enable_lora else None,
        "weights": _fingerprint([(tuple(w.shape), str(w.dtype)) for w in weights]),
    }
    if kv_groups:
        engine["kv_groups"] = [list(g) for g in kv_groups]
    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "code": code_hash()}
    # Through JSON, so that it compares equal to a manifest read back (tuples -> lists).
    return json.loads(json.dumps({"target": target, "versions": versions, "engine": engine}))


def _fingerprint(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


@functools.cache
def code_hash() -> str:
    """A hash of the code that builds the programs: the engine (`jaxserve`), the
    models and the kernels (Python and C++ sources)."""
    import models
    import pallas_kernels

    h = hashlib.sha256()
    for package in (jaxserve, models, pallas_kernels):
        top = package.__path__[0]
        for root, dirs, files in os.walk(top):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".cc", ".h")):
                    path = os.path.join(root, name)
                    h.update(os.path.relpath(path, os.path.dirname(top)).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()[:16]


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(values: dict, key: str) -> str:
    text = repr(values[key]) if key in values else "(none)"
    return text if len(text) <= 80 else text[:77] + "..."


def check(found: dict, expected: dict, directory: str) -> None:
    """Raises ValueError naming every field where the bundle's manifest (`found`)
    differs from this engine's (`expected`)."""
    have, want = _flat(found), _flat(expected)
    diffs = [  # target first, then versions, then the engine's settings
        f"{key}: bundle's {_show(have, key)}, this engine's {_show(want, key)}"
        for key in dict.fromkeys([*want, *have])
        if have.get(key) != want.get(key)
    ]
    if diffs:
        raise ValueError(
            f"compiled bundle {directory} was made for another target, jax version, code or "
            "configuration; make it again for this one (jaxserve preflight --output, or "
            "LLM(...).save_compiled). Differences: " + "; ".join(diffs)
        )


def _read_trusted(directory: str, name: str) -> bytes:
    """A file of the bundle, read from a descriptor whose file was checked as code
    (the module's docstring); ValueError naming it and why it is not trusted."""
    try:
        fd = trust.open_checked(os.path.join(directory, name), private=False)
    except trust.UnsafeCacheError as e:
        raise _untrusted(directory, e) from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def check_directory(directory: str) -> None:
    """Raises ValueError naming `directory` and why, unless a bundle may be loaded
    from it (the module's docstring); FileNotFoundError if there is none."""
    try:
        trust.check_dir(os.path.abspath(directory), private=False)
    except trust.UnsafeCacheError as e:
        raise _untrusted(directory, e) from None


def _untrusted(directory: str, why: trust.UnsafeCacheError) -> ValueError:
    return ValueError(
        f"compiled bundle {directory}: refused, {why}: a bundle is code (pickles and "
        "native programs), loaded only where no other user could have written it"
    )


def read_manifest(directory: str) -> dict:
    """The bundle's manifest; ValueError if `directory` holds no bundle of this format,
    or one that is not to be trusted (`check_directory`)."""
    try:
        check_directory(directory)
        found = json.loads(_read_trusted(directory, MANIFEST))
    except FileNotFoundError:
        raise ValueError(
            f"compiled={directory!r} holds no bundle ({MANIFEST} missing): make one with "
            "`jaxserve preflight --output=DIR` or `LLM(...).save_compiled(DIR)`"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"compiled bundle {directory}: cannot read {MANIFEST}: {e}") from None
    version = found.get("format") if isinstance(found, dict) else None
    if version != FORMAT:
        raise ValueError(
            f"compiled bundle {directory}: format {version!r}, this jaxserve reads format {FORMAT}"
        )
    return found


# -------------------------------------------------------------- save / load


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9=+.-]", "_", name) + ".bin"


_PROGRAM_FILE = re.compile(r"[A-Za-z0-9=+_-][A-Za-z0-9=+._-]*\.bin")  # `_file_name`'s


def save(directory: str, compiled: dict[str, jax.stages.Compiled], described: dict) -> int:
    """Writes the programs and their manifest into `directory` (created; an older
    bundle there is replaced); returns the bytes written. The manifest goes last, so
    an interrupted save leaves no loadable bundle."""
    if not compiled:
        raise ValueError("no compiled programs to save: the engine was built with warmup=False")
    os.makedirs(directory, mode=0o755, exist_ok=True)  # (unwritable by others: `load`)
    path = os.path.join(directory, MANIFEST)
    if os.path.exists(path):
        os.remove(path)
    elif os.listdir(directory):
        raise ValueError(f"{directory} is not empty and holds no bundle: give a new directory")
    programs, total = {}, 0
    for name, program in sorted(compiled.items()):
        data = pickle.dumps(compile_records.serialized(program))
        file = _file_name(name)
        with _create(os.path.join(directory, file), "wb") as f:
            f.write(data)
        programs[name] = {"file": file, "sha256": hashlib.sha256(data).hexdigest()}
        total += len(data)
    with _create(path + ".tmp", "w") as f:
        json.dump({"format": FORMAT, **described, "programs": programs}, f, indent=1)
    os.replace(path + ".tmp", path)
    return total


def _create(path: str, mode: str):
    """A new file that no other user may write, whatever the umask (`load` checks)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), mode)


def load(
    directory: str, expected: dict, devices: Sequence[jax.Device]
) -> dict[str, jax.stages.Compiled]:
    """The bundle's programs loaded onto `devices` (the engine's, in mesh order),
    after `check`ing its manifest against `expected`. Nothing is compiled, and the
    persistent compilation cache is not consulted."""
    found = read_manifest(directory)
    programs = found.pop("programs", {})
    del found["format"]
    check(found, expected, directory)
    backend = devices[0].client
    loaded = {}
    for name, entry in programs.items():
        file = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(file, str) or not _PROGRAM_FILE.fullmatch(file):
            raise ValueError(
                f"compiled bundle {directory}: program {name!r} names file {file!r}, not "
                "a program file of the bundle"
            )
        data = _read_trusted(directory, file)
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise ValueError(f"compiled bundle {directory}: {entry['file']} ({name}) is corrupt")
        serialized, in_tree, out_tree = pickle.loads(data)
        loaded[name] = serialize_executable.deserialize_and_load(
            serialized, in_tree, out_tree, backend=backend, execution_devices=list(devices)
        )
    return loaded


# ----------------------------------------------------------------- calling


class ByShape:
    """Calls one function's loaded executables by the shapes of its arguments.

    Called with the jitted function's arguments: the static ones (`static_argnums`,
    baked into the executables) are dropped, and the shapes of the arguments at
    `key_argnums` (counted among the rest) pick the executable.
    """

    def __init__(
        self,
        what: str,
        programs: dict[str, jax.stages.Compiled],
        static_argnums: tuple[int, ...] = (),
        key_argnums: tuple[int, ...] = (),
    ):
        if not programs:
            raise ValueError(f"the compiled bundle has no {what} programs")
        self.what, self.static, self.keys = what, frozenset(static_argnums), key_argnums
        self.names = sorted(programs)
        self.by_key = {}
        for name, program in programs.items():
            args = program.args_info[0]
            key = self._key([args[i] for i in key_argnums])
            if key in self.by_key:  # the shapes could not tell them apart
                raise ValueError(f"{what} programs {name!r} and another take shapes {key[1]}")
            self.by_key[key] = program

    @staticmethod
    def _key(args) -> tuple:
        """The arguments' structure (a packed batch's layout with it) and shapes."""
        leaves, structure = jax.tree.flatten(args)
        return structure, tuple(tuple(np.shape(x)) for x in leaves)

    def __call__(self, *args):
        args = [a for i, a in enumerate(args) if i not in self.static]
        key = self._key([args[i] for i in self.keys])
        program = self.by_key.get(key)
        if program is None:
            raise ValueError(
                f"no compiled {self.what} program for argument shapes {key[1]} in the bundle "
                f"(it has {', '.join(self.names)})"
            )
        return program(*args)


def by_shape(compiled: dict, prefix: str, **kw) -> Callable:
    """`ByShape` over the programs whose names start with `prefix`."""
    named = {name: c for name, c in compiled.items() if name.startswith(prefix)}
    what = prefix.rsplit(" ", 1)[0] if prefix.endswith("=") else prefix  # "forward T=" -> "forward"
    return ByShape(what, named, **kw)


def step_programs(
    compiled: dict, base: StepPrograms, prefix: str = "", sampling: bool = True
) -> StepPrograms:
    """`base` with its forward (and, with `sampling`, its sampling and prompt-logprob)
    steps the bundle's programs, picked by the batch's token bucket and the sampling
    rows' bucket. The draft model's have `prefix` "draft " and only a forward.
    `logits_step` is not part of warm-up and stays jitted (`ModelRunner.execute`,
    for tests; serving never calls it)."""
    forward = by_shape(compiled, prefix + "forward T=", static_argnums=(0,), key_argnums=(2,))
    if not sampling:
        return dataclasses.replace(base, forward=forward)
    # (weights, selected, sampling, prev_tokens): the sampling metadata's shapes pick.
    sample = by_shape(compiled, prefix + "sample", static_argnums=(0,), key_argnums=(2,))
    # (weights, hidden, targets): the token rows' hidden states pick.
    prompt_lp = by_shape(
        compiled, prefix + "prompt logprobs T=", static_argnums=(0,), key_argnums=(1,)
    )
    return dataclasses.replace(
        base,
        forward=forward,
        sample_step=sample,
        prompt_logprobs=prompt_lp,
        table_writes=compiled["page table writes"],
    )
