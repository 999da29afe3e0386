"""An HTTP proxy on loopback that breaks an S3 server's answers on purpose (for chaos tests).

It forwards every request to an upstream S3 endpoint (moto's server) and, with seeded
probabilities, answers 503 SlowDown instead, stalls before answering, or resets the
connection; ``lose_next_ref_answer()`` makes it forward the next write of an Icechunk ref
(a commit's last step) and then drop the connection, so the write happened but its answer
was lost.  Counters say what it did.
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field

__all__ = ["FaultyProxy"]


@dataclass
class Faults:
    p_503: float = 0.0
    p_reset: float = 0.0
    p_stall: float = 0.0
    stall_seconds: float = 1.0
    counts: dict[str, int] = field(
        default_factory=lambda: {"forwarded": 0, "503": 0, "reset": 0, "stall": 0, "lost_answer": 0}
    )


class FaultyProxy:
    """``with FaultyProxy(upstream) as proxy: ... proxy.endpoint_url ...``"""

    def __init__(self, upstream: str, seed: int = 0):
        self.upstream = upstream.rstrip("/")
        self.faults = Faults()
        self.rng = random.Random(seed)
        self._lose_ref = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="faulty-proxy")
        self.endpoint_url: str | None = None

    def set_faults(
        self, *, p_503: float = 0.0, p_reset: float = 0.0, p_stall: float = 0.0, stall_seconds: float = 1.0
    ) -> None:
        self.faults.p_503, self.faults.p_reset, self.faults.p_stall = p_503, p_reset, p_stall
        self.faults.stall_seconds = stall_seconds

    def lose_next_ref_answer(self) -> None:
        self._lose_ref = True

    async def _handle(self, request):
        import aiohttp
        from aiohttp import web

        body = await request.read()
        f, draw = self.faults, self.rng.random()
        lose = self._lose_ref and request.method == "PUT" and "/refs/" in request.path
        if not lose:
            if draw < f.p_503:
                f.counts["503"] += 1
                return web.Response(
                    status=503,
                    content_type="application/xml",
                    text=(
                        "<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                        "<Message>Please reduce your request rate.</Message></Error>"
                    ),
                )
            if draw < f.p_503 + f.p_reset:
                f.counts["reset"] += 1
                request.transport.abort()
                raise asyncio.CancelledError  # nothing more to say on a dead connection
            if draw < f.p_503 + f.p_reset + f.p_stall:
                f.counts["stall"] += 1
                await asyncio.sleep(f.stall_seconds)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=60),
        ) as resp:
            payload = await resp.read()
            dropped = ("transfer-encoding", "content-encoding", "connection")
            if request.method != "HEAD":  # a HEAD answer's Content-Length is the object's size: keep it
                dropped += ("content-length",)
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in dropped}
            f.counts["forwarded"] += 1
            if lose and 200 <= resp.status < 300:
                self._lose_ref = False
                f.counts["lost_answer"] += 1
                request.transport.abort()  # the write is done upstream; its answer never arrives
                raise asyncio.CancelledError
            if request.method == "HEAD":
                response = web.StreamResponse(status=resp.status, headers=out_headers)
                await response.prepare(request)
                return response
            return web.Response(status=resp.status, headers=out_headers, body=payload)

    async def _start(self, port: int) -> None:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    def __enter__(self) -> FaultyProxy:
        from .s3 import free_port

        port = free_port()
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(port), self._loop).result(30)
        self.endpoint_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
