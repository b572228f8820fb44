import dataclasses
import socket
import subprocess
import sys
from contextlib import contextmanager

import pytest
from support.fakes import fake_plan

from kvpool.engine import ports
from kvpool.engine.errors import FleetError
from kvpool.engine.ports import port_is_free


@contextmanager
def another_process(code: str):
    """Another process that runs ``code`` and then holds on (its pid yielded once it has), killed after."""
    script = f"import time; {code}; print('ready', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        yield process.pid
    finally:
        process.kill()
        process.wait()


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


def test_a_port_another_run_is_starting_a_server_on_is_not_free_and_an_auto_port_moves_off_it():
    """Two runs planning at the same moment: the one that claimed a port first keeps it until its server
    is healthy; the other sees it taken before anything listens on it, and its auto port moves."""
    port = ports.free_ports("127.0.0.1", 1, start=18900, span=90)[0]
    with another_process(f"from kvpool.engine import ports; assert ports.claim_port({port})"):
        assert ports.claimed_elsewhere(port) and not ports.port_is_free("127.0.0.1", port)
        assert port not in ports.free_ports("127.0.0.1", 3, start=port, span=40)
        plan = fake_plan("serve", count=1, ports=[port])
        moved, held = ports.claimed(plan, ports.resolve_ports, lambda p: [r.port for r in p.replicas])
        assert held == [moved.replicas[0].port] and held != [port] and not ports.claimed_elsewhere(held[0])
        ports.release_ports(held)
        with pytest.raises(FleetError, match=r"configured ports are in use.*claimed by another kvpool run"):
            ports.claimed(dataclasses.replace(plan, port_source="config"), ports.resolve_ports, lambda p: [port])
    assert not ports.claimed_elsewhere(port)  # the kernel let go of a dead holder's claim


def test_a_configured_port_in_use_is_refused_naming_the_process_that_listens_on_it():
    port = ports.free_ports("127.0.0.1", 1, start=18990, span=90)[0]
    with another_process(f"import socket; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()") as pid:
        plan = fake_plan("serve", count=1, ports=[port], source="config")
        with pytest.raises(FleetError, match=rf"replica 0 port {port} \(held by pid {pid} \(\S*python"):
            ports.resolve_ports(plan)
