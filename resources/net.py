"""Where our servers listen: loopback unless told otherwise, and a warning when told otherwise.

The Dask scheduler runs whatever code its clients send (pickled functions) and the Lambda
emulation runs reward functions for anyone who posts to it, so neither should be reachable from
other machines by accident.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine only. ``localhost`` and loopback
    addresses are; ``0.0.0.0``, ``::``, ``""`` (every interface) and interface addresses are
    not; another name is loopback only if every address it resolves to is."""
    name = host.strip().strip("[]")
    if not name:
        return False  # "" binds every interface
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False  # unresolvable here: do not claim it is safe
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
    )


def warn_if_exposed(what: str, host: str) -> bool:
    """Log a WARNING when ``what`` is about to listen on a non-loopback ``host``; returns
    whether it did."""
    if is_loopback(host):
        return False
    logger.warning(
        "%s binds %r: it is reachable from other machines (bind 127.0.0.1 to keep it on this one)",
        what,
        host,
    )
    return True
