"""Bearer tokens (RFC 6750), shared by the daemon's API and the engine's fault route."""
from __future__ import annotations

# The engine's /admin/faults token when no --fault-token-file names one; `up --demo-drift`
# hands its engine one this way (the engine's environment alone, not the daemon's).
FAULT_TOKEN_ENV = "AC_OBSERVE_FAULT_TOKEN"


def bearer_token(header: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, as the client's bytes."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("latin-1")  # the header's bytes, as they came


def header_token_ok(token: str | None) -> bool:
    """A token an Authorization header can carry as sent: printable ASCII, no white space
    (a byte outside ASCII fails httpx's encoding, or the latin-1 compare on arrival)."""
    if not token:
        return False
    return all(33 <= ord(c) <= 126 for c in token)
