"""A command-line client: streams a completion to the terminal.

jaxserve client --prompt="If the file does not exist," --max_tokens=32
python -m server.cli.client --target=host:50051 --chat="Hello" --temperature=0.7
"""

from __future__ import annotations

import sys

import grpc
from absl import app, flags

from server import jaxserve_pb2 as pb
from server import jaxserve_pb2_grpc as pb_grpc

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "127.0.0.1:50051", "Server address.")
flags.DEFINE_string("prompt", None, "Text to complete.")
flags.DEFINE_string("chat", None, "A user message, rendered with the model's chat template.")
flags.DEFINE_integer("max_tokens", 64, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "0 is greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
flags.DEFINE_integer("seed", None, "Sampling seed.")
flags.DEFINE_string("api_key", None, "API key, if the server needs one.")
flags.DEFINE_string("tls_ca", None, "PEM root certificate to connect with TLS.")
flags.DEFINE_float("timeout_s", 300.0, "Deadline for the whole request.")


def build_request() -> pb.GenerateRequest:
    params = pb.SamplingParams(
        max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p
    )
    if FLAGS.seed is not None:
        params.seed = FLAGS.seed
    request = pb.GenerateRequest(sampling_params=params)
    if FLAGS.chat is not None:
        request.messages.messages.add(role="user", content=FLAGS.chat)
    elif FLAGS.prompt is not None:
        request.prompt = FLAGS.prompt
    else:
        raise app.UsageError("give --prompt or --chat")
    return request


def main(argv) -> None:
    del argv
    request = build_request()
    if FLAGS.tls_ca:
        with open(FLAGS.tls_ca, "rb") as f:
            channel = grpc.secure_channel(FLAGS.target, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(FLAGS.target)
    metadata = [("authorization", f"Bearer {FLAGS.api_key}")] if FLAGS.api_key else None
    stub = pb_grpc.JaxServeStub(channel)
    try:
        if FLAGS.prompt is not None:
            sys.stdout.write(FLAGS.prompt)
        for msg in stub.Generate(request, timeout=FLAGS.timeout_s, metadata=metadata):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            if msg.HasField("usage"):
                u = msg.usage
                sys.stdout.write("\n")
                print(
                    f"[{u.prompt_tokens} prompt tokens ({u.cached_prompt_tokens} cached), "
                    f"{u.completion_tokens} generated]",
                    file=sys.stderr,
                )
    except grpc.RpcError as e:
        raise SystemExit(f"\n{e.code().name}: {e.details()}") from None
    finally:
        channel.close()


if __name__ == "__main__":
    app.run(main)
