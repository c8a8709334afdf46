"""What moving bytes over loopback costs in CPU: the websocket the learners and the syncer speak
(aiohttp on uvloop, binary messages) against a bare TCP socket, in the same run.

One sender process and one receiver process per transport (spawn), `total_bytes` sent as messages of
`message_bytes`; each side's process time (every thread) over its part. The websocket side is what
the syncer's daemon and client use, with nothing of ours on top: the client masks its frames, as
RFC 6455 asks of clients, and the server unmasks and reassembles them. The bare socket is `sendall`
of one buffer and `recv_into` a reused one: what the kernel's loopback costs with no framing.
`bench sync` runs it after its syncs, so that a sync's CPU can be set against the wire's share.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import time

from ddiloco.errors import FaultError

__all__ = ["WIRE_S_MAX", "WireBenchError", "serve_websocket", "wire_cost"]

WIRE_S_MAX = 120.0  # the longest either side of one transport may take
TRANSPORTS = ("websocket", "tcp")


class WireBenchError(FaultError, RuntimeError):
    """A side of the wire measurement did not finish."""

    what_to_do = "run it again; on a loaded machine, with fewer bytes"


async def serve_websocket(handler) -> tuple[object, int]:
    """A bare aiohttp server of `handler` at /ws on 127.0.0.1, on a free port: (its runner, the
    port). The caller cleans the runner up."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/ws", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def _ws_receiver(total: int, ports, out) -> None:
    from aiohttp import WSMsgType, web

    from ddiloco.net.server import use_uvloop

    use_uvloop()

    async def main() -> None:
        done = asyncio.Event()
        got = [0, 0.0, None, 0.0]  # bytes, CPU, first arrival, last

        async def handler(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(max_msg_size=0)
            await ws.prepare(request)
            cpu = time.process_time()
            async for msg in ws:
                if msg.type is WSMsgType.BINARY:
                    got[0] += len(msg.data)
                    got[2], got[3] = got[2] or time.monotonic(), time.monotonic()
                    if got[0] >= total:
                        break
            got[1] = time.process_time() - cpu
            done.set()
            return ws

        runner, port = await serve_websocket(handler)
        ports.put(port)
        await asyncio.wait_for(done.wait(), WIRE_S_MAX)
        await runner.cleanup()
        out.put(("receiver", got[0], got[1], got[3] - (got[2] or got[3])))

    asyncio.run(main())


def _ws_sender(total: int, message: int, port: int, out) -> None:
    import aiohttp

    from ddiloco.net.server import use_uvloop

    use_uvloop()

    async def main() -> None:
        data, sent = bytes(message), 0
        async with aiohttp.ClientSession() as http, http.ws_connect(f"ws://127.0.0.1:{port}/ws", max_msg_size=0) as ws:
            cpu = time.process_time()
            while sent < total:
                await ws.send_bytes(data)
                sent += message
            out.put(("sender", sent, time.process_time() - cpu, 0.0))
            await ws.receive(timeout=WIRE_S_MAX)  # the server's close, once it has every byte

    asyncio.run(main())


def _tcp_receiver(total: int, ports, out) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        ports.put(server.getsockname()[1])
        server.settimeout(WIRE_S_MAX)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(WIRE_S_MAX)
            view, got, first = memoryview(bytearray(1 << 22)), 0, None
            cpu = time.process_time()
            while got < total:
                n = conn.recv_into(view)
                if not n:
                    break
                got += n
                first = first or time.monotonic()
            out.put(("receiver", got, time.process_time() - cpu, time.monotonic() - (first or time.monotonic())))


def _tcp_sender(total: int, message: int, port: int, out) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=WIRE_S_MAX) as conn:
        data, sent = bytes(message), 0
        cpu = time.process_time()
        while sent < total:
            conn.sendall(data)
            sent += message
        out.put(("sender", sent, time.process_time() - cpu, 0.0))


def _one(transport: str, total: int, message: int) -> dict:
    receiver, sender = (_ws_receiver, _ws_sender) if transport == "websocket" else (_tcp_receiver, _tcp_sender)
    ctx = mp.get_context("spawn")
    ports, out = ctx.Queue(), ctx.Queue()
    recv = ctx.Process(target=receiver, args=(total, ports, out), daemon=True)
    recv.start()
    procs = [recv]
    try:
        port = ports.get(timeout=WIRE_S_MAX)
        send = ctx.Process(target=sender, args=(total, message, port, out), daemon=True)
        send.start()
        procs.append(send)
        # name -> (bytes, CPU seconds, the receiver's first arrival to its last)
        sides = {name: rest for name, *rest in (out.get(timeout=WIRE_S_MAX) for _ in range(2))}
    except Exception as exc:  # noqa: BLE001 - queue.Empty or a side that died: said as one fault
        raise WireBenchError(f"the {transport} measurement did not finish: {type(exc).__name__} {exc}") from exc
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if sides["receiver"][0] < total:
        raise WireBenchError(f"the {transport} receiver got {sides['receiver'][0]} of {total} bytes")
    cpu = sides["sender"][1] + sides["receiver"][1]
    return {
        "gbps": total / sides["receiver"][2] / 1e9 if sides["receiver"][2] > 0 else 0.0,
        "cpu_s": cpu,
        "sender_cpu_s": sides["sender"][1],
        "receiver_cpu_s": sides["receiver"][1],
        "cpu_ns_per_byte": 1e9 * cpu / total,
    }


def wire_cost(total_bytes: int, message_bytes: int) -> dict:
    """Per transport (websocket, tcp): GB/s and CPU (seconds, and ns per byte, both sides summed) of
    sending `total_bytes` over loopback as messages of `message_bytes`."""
    if not 0 < message_bytes <= total_bytes:
        raise ValueError(f"need 0 < message_bytes <= total_bytes, got {message_bytes} and {total_bytes}")
    return {transport: _one(transport, total_bytes, message_bytes) for transport in TRANSPORTS}
