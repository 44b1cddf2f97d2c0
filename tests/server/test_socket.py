"""The listening socket: connections accepted on it send small writes at once (TCP_NODELAY)."""

from __future__ import annotations

import asyncio
import socket

from kvserve.entrypoints.openai.api_server import bind_listening


def test_accepted_connections_have_nagle_off() -> None:
    """Each SSE chunk is a small write on a kept-alive connection; with Nagle's algorithm on, a chunk waits
    for the client's delayed ACK of the one before (up to 40 ms on Linux)."""

    async def scenario() -> int:
        sock = bind_listening("127.0.0.1", 0)
        port = sock.getsockname()[1]
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(scenario()) != 0
