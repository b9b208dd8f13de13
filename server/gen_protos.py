"""Regenerates the committed Python stubs from server/jaxserve.proto.

python -m server.gen_protos            # rewrite server/jaxserve_pb2*.py
python -m server.gen_protos --out DIR  # write them elsewhere (the staleness test)
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(out_dir: str) -> list[str]:
    from grpc_tools import protoc

    os.makedirs(os.path.join(out_dir, "server"), exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        os.path.join(ROOT, "server", "jaxserve.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return [
        os.path.join(out_dir, "server", name)
        for name in ("jaxserve_pb2.py", "jaxserve_pb2.pyi", "jaxserve_pb2_grpc.py")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=ROOT, help="root to write server/*_pb2*.py under")
    for path in generate(parser.parse_args().out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
