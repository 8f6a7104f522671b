"""What the fault tests share: the stack's timing settings, and a small TCP proxy whose every
forwarded piece is delayed and whose every connection is cut after a while (TLS passes
through untouched)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

PASS_MS = 80  # every target pass sleeps this long: 32 tokens take >= ~1 s at any acceptance
LEASE_S = 2.0  # short, so a router's death is noticed quickly (production default 5 s)
DETACHED_IDLE_S = 3.0  # a session nobody reads is cancelled after this (production default 60 s)


class FlakyProxy:
    def __init__(self, upstream: str, delay_s: float, cut_after_s: float) -> None:
        self.host, port = upstream.rsplit(":", 1)
        self.port = int(port)
        self.delay_s = delay_s
        self.cut_after_s = cut_after_s
        self.dropped = 0  # connections cut so far
        self.loop = asyncio.new_event_loop()
        self.address = ""
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FlakyProxy:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop)
        self.server = server.result(10)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        up = asyncio.ensure_future(self._pump(reader, up_writer))
        down = asyncio.ensure_future(self._pump(up_reader, writer))
        done, _ = await asyncio.wait({up, down}, timeout=self.cut_after_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            self.dropped += 1
        for task in (up, down):
            task.cancel()
        for w in (writer, up_writer):
            with contextlib.suppress(Exception):
                w.transport.abort()  # a cut, not a clean close

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            await asyncio.sleep(self.delay_s)
            writer.write(data)
            await writer.drain()
