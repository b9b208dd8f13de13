"""`jaxserve <command> [--flags]`: dispatches to a command module.

Each command module defines its own absl flags; only the chosen one is imported,
so commands never collide on flag names.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("server.cli.generate", "offline batch generation"),
    "serve": ("server.cli.serve", "the gRPC server"),
    "client": ("server.cli.client", "stream a completion from a server"),
    "bench": ("server.cli.bench", "throughput and latency benchmarks"),
    "convert": ("server.cli.convert", "write a model directory as an orbax checkpoint"),
    "preflight": ("server.cli.preflight", "compile for a TPU or GPU target before renting it"),
    "kernels": ("server.cli.kernels", "build the C++ CPU kernels now (kernels build)"),
}


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
    module = importlib.import_module(COMMANDS[command][0])
    if any(a in _HELP for a in argv[2:]):
        print(command_help(command))
        sys.exit(0)
    from absl import app

    app.run(module.main, argv=[f"jaxserve {command}", *argv[2:]])


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
