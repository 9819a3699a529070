"""Listening sockets serve without Nagle; nodes of one machine split its cores.

Both were measured as large latency costs (docs/architecture.md: CPU threads): Nagle on a
node's accepted sockets held every small SSE write after the first for the client's
delayed ACK, and nodes each running one forward thread per core kept the cores
oversubscribed."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.config import EngineConfig
from pdserve.cpus import split_cores, usable_cores
from pdserve.ports import bind_port
from pdserve.stack.config import StackConfig


async def _accepted_nodelay(sock: socket.socket) -> int:
    """TCP_NODELAY of the server side of one connection that asyncio accepted on `sock`."""
    seen: asyncio.Future = asyncio.get_running_loop().create_future()

    def on_client(reader, writer) -> None:
        s = writer.get_extra_info("socket")
        seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock.listen(8)
    server = await asyncio.start_server(on_client, sock=sock)
    try:
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        return value
    finally:
        server.close()
        await server.wait_closed()


def test_node_sockets_turn_nagle_off_on_accepted_connections():
    assert asyncio.run(_accepted_nodelay(bind_port("127.0.0.1", 0))) != 0


def test_a_socket_without_the_tcp_protocol_keeps_nagle():
    """Why `bind_port` names IPPROTO_TCP: asyncio skips TCP_NODELAY for proto 0."""
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    plain.bind(("127.0.0.1", 0))
    assert asyncio.run(_accepted_nodelay(plain)) == 0


@pytest.mark.parametrize("nodes,cores,want", [(1, 2, 2), (2, 2, 1), (3, 2, 1), (3, 16, 5),
                                              (4, 16, 4)])
def test_split_cores_gives_every_node_at_least_one_thread(nodes, cores, want):
    assert split_cores(nodes, cores) == want
    assert split_cores(nodes, cores) * nodes <= max(cores, nodes)


def test_split_cores_defaults_to_this_machines_cores():
    assert split_cores(1) == usable_cores()


def test_negative_thread_counts_are_refused():
    with pytest.raises(ValueError, match="threads must be >= 0"):
        EngineConfig(threads=-1)
    with pytest.raises(ValueError, match="--node-threads must be >= 0"):
        StackConfig(model="tiny-llama", node_threads=-2)
