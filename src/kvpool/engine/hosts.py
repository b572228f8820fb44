"""Which addresses kvpool's servers listen on. Replicas bind ``engine.host`` (loopback unless the config opts
in with ``engine.allow_remote``); pool servers (LMCache's MP server, Redis) always bind loopback, since every
replica that uses them runs on this machine: neither server asks a client for a key (LMCache's ``redis://``
URL carries no password kvpool could keep out of the plan and the logs), so one reachable from the network
would serve and take anyone's chunks."""

from __future__ import annotations

import ipaddress

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: config refuses it on its own
        return False


def pool_server_host(engine_host: str) -> str:
    """The address a cell's pool servers bind: the replicas' own when it is loopback, else 127.0.0.1."""
    return engine_host if is_loopback(engine_host) else LOOPBACK
