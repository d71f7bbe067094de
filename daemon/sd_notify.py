"""systemd's readiness protocol, written by hand (no libsystemd): a datagram of
`KEY=value` lines to the socket in $NOTIFY_SOCKET, when systemd runs the daemon as
`Type=notify` (deploy/systemd/ac-observe.service). Without $NOTIFY_SOCKET, nothing is sent.
"""
from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("ac_observe.daemon.sd_notify")


def notify(*lines: str) -> bool:
    """Send `lines` (READY=1, RELOADING=1, STOPPING=1, STATUS=...); whether it was sent."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address or address[0] not in "@/":
        return False
    # "@name": the abstract namespace (a leading NUL byte).
    target = "\0" + address[1:] if address[0] == "@" else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall("\n".join(lines).encode())
        return True
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", address, exc.strerror or exc)
        return False


def reloading() -> bool:
    """RELOADING=1 with the monotonic time systemd asks it to carry."""
    microseconds = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify("RELOADING=1", f"MONOTONIC_USEC={microseconds}")
