"""`jaxserve <command> [--flags]`: dispatches to a command module.

Each command module defines its own absl flags; only the chosen one is imported,
so commands never collide on flag names. Flag names may be written vLLM's way, with
dashes (`--max-model-len=4096`, `--no-enable-prefix-caching`): they are the same
flags as absl's `--max_model_len=4096`, `--noenable_prefix_caching`.
"""

from __future__ import annotations

import gc
import importlib
import itertools
import os
import sys

# Device nodes of an accelerator JAX could use (NVIDIA, TPU v4/v5e, AMD); a TPU whose
# chips are VFIO devices has entries in /dev/vfio beside its "vfio" control node.
_ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/accel0", "/dev/kfd")

COMMANDS = {
    "generate": ("server.cli.generate", "offline batch generation"),
    "serve": (
        "server.cli.serve",
        "the OpenAI-compatible HTTP server (--port, 8000) and gRPC (--grpc_port, 50051)",
    ),
    "client": ("server.cli.client", "stream a completion from a server"),
    "bench": ("server.cli.bench", "throughput and latency benchmarks"),
    "convert": ("server.cli.convert", "write a model directory as an orbax checkpoint"),
    "preflight": ("server.cli.preflight", "compile for a TPU or GPU target before renting it"),
    "kernels": ("server.cli.kernels", "build the C++ CPU kernels now (kernels build)"),
}


# The cyclic garbage collector's thresholds in a jaxserve process (Python's: 700, 10,
# 10). Start-up traces and lowers every program, allocating millions of objects that
# live until the programs are built, and with the defaults the collector ran over them
# again and again: the demo model's warm-cache start took 3.2 s, 2.7 s with these
# (this EPYC); young garbage is still collected. A step's own garbage is freed by
# reference counts: its host time did not move (benchmarks/host_path.py, 256 running).
GC_THRESHOLDS = (50_000, 50, 1000)


def _usage() -> str:
    lines = ["usage: jaxserve <command> [--flags]  (jaxserve <command> --help for flags)", ""]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(_usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    command = argv[1]
    if command not in COMMANDS:
        print(f"jaxserve: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        sys.exit(2)
    _local_platform(os.environ)
    gc.set_threshold(*GC_THRESHOLDS)  # (the process is the command's)
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        _import_jax_quietly()
    module = importlib.import_module(COMMANDS[command][0])
    if any(a in _HELP for a in argv[2:]):
        print(command_help(command))
        sys.exit(0)
    from absl import app, flags

    args = normalize_flag_names(argv[2:], flags.FLAGS)
    app.run(module.main, argv=[f"jaxserve {command}", *args])


def _local_platform(environ) -> None:
    """On a machine with no accelerator, JAX asks the CPU only (JAX_PLATFORMS=cpu,
    unless set): its CUDA and TPU plugins, when installed (the compile and test
    extras), printed a 30-line "Unable to load CUDA" traceback and libtpu errors
    before every command. Before JAX is imported (it reads the variable once)."""
    if "JAX_PLATFORMS" in environ:
        return
    vfio = os.listdir("/dev/vfio") if os.path.isdir("/dev/vfio") else []
    if any(map(os.path.exists, _ACCELERATOR_NODES)) or any(n != "vfio" for n in vfio):
        return
    environ["JAX_PLATFORMS"] = "cpu"


# What CUDA's libraries log natively (absl, to fd 2) as JAX's GPU modules load and
# find no GPU: on a machine JAX asks for the CPU alone, nothing worth reading.
_PROBE_NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog()")


def _import_jax_quietly() -> None:
    """Imports JAX, and has it find its plugins (not start its backends: a multi-host
    start initializes `jax.distributed` first), with fd 2 going to a file; then writes
    back all of it but the lines of `_PROBE_NOISE` (a CPU command printed 8)."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            from jax._src import xla_bridge

            # (JAX's own step before its first backend; private, so only where it is.)
            getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not any(noise in line for noise in _PROBE_NOISE):
                    sys.stderr.write(line)
            sys.stderr.flush()


def normalize_flag_names(args: list[str], known) -> list[str]:
    """`--flag-name[=value]` -> `--flag_name[=value]` (absl's spelling; vLLM's has
    dashes), and `--no-flag-name` -> `--noflag_name` for a boolean `flag_name`.

    Only the name of a `--` argument changes: never a value (after `=`, or the
    argument after a flag of the `known` FlagValues that takes one), a positional
    argument, or anything after `--`.
    """
    out: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg == "--":
            out += [arg, *rest]
            break
        if not arg.startswith("--"):
            out.append(arg)
            continue
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name.startswith("no_") and name not in known and _is_bool(known, name[3:]):
            name = "no" + name[3:]
        out.append(f"--{name}{eq}{value}")
        if not eq and name in known and not known[name].boolean:
            out += itertools.islice(rest, 1)  # its value, as given
    return out


def _is_bool(known, name: str) -> bool:
    return name in known and known[name].boolean


_HELP = ("-h", "--help", "-help", "--helpshort", "-?")


def command_help(command: str) -> str:
    """The command's docstring and every flag it takes (its own, then the shared ones).

    absl's own --help lists only the flags of `__main__`, which is this dispatcher.
    """
    from absl import flags

    name = COMMANDS[command][0]
    module = sys.modules[name]
    by_module = flags.FLAGS.flags_by_module_dict()
    sections = [(module.__doc__ or "").strip()]
    for mod in [name, *sorted(m for m in by_module if m.startswith("server.cli.") and m != name)]:
        if mod in by_module:
            sections.append(flags.FLAGS.module_help(mod))
    return "\n\n".join(sections)


if __name__ == "__main__":
    run()
