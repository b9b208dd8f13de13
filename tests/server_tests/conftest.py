import asyncio
import threading

import pytest

from jaxserve import LLM
from server.app import JaxServeServer, ServerOptions

# The `LLM` arguments of a test server's engine (`ServerThread`; `llm_kwargs` add to them).
SERVER_LLM = dict(
    max_model_len=128,
    block_size=8,
    num_kv_pages=256,
    max_num_seqs=32,
    max_num_batched_tokens=256,
    warmup=False,
)


class ServerThread:
    """A JaxServeServer on its own event loop in a background thread."""

    def __init__(self, model_dir, *, load=True, llm_kwargs=None, **options):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        kw = {**SERVER_LLM, **(llm_kwargs or {})}

        def make_engine():
            llm = LLM(model_dir, **kw)
            return llm.engine, llm.tokenizer

        opts = ServerOptions(**{"grpc_port": 0, "metrics_port": 0, **options})
        self.server = self.call(self._create(make_engine, opts))
        self.port = self.call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"
        if load:
            self.load()

    async def _create(self, make_engine, opts):
        return JaxServeServer(make_engine, opts, model_name="tiny")

    def call(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def load(self):
        self.call(self.server.load())

    @property
    def engine(self):
        return self.server.state.engine.engine

    @property
    def http_url(self) -> str:
        """The HTTP server's base URL (one started with http_port=0)."""
        return f"http://127.0.0.1:{self.server.http_port}"

    def stop(self):
        self.call(self.server.stop(grace=1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    server = ServerThread(tiny_model_dir)
    yield server
    server.stop()
