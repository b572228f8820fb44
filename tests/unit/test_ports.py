import socket

from kvpool.engine.fleet import port_is_free


def test_listening_port_is_taken_and_closed_one_is_free():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's API server does
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end lingers in TIME_WAIT
        client.close()
    assert port_is_free("127.0.0.1", port)
