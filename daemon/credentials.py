"""Who may use the daemon's routes: the bearer token (`--token-file`) and the web-config
file's basic-auth users (bcrypt hashes), side by side: when either is configured, a request
must carry one that matches, and either admits it.

bcrypt is slow on purpose (~70 ms at cost 10): a verified (user, password, hash) is
remembered (a SHA-256 of the three, never the password), so a scraper's every scrape
after its first costs a hash lookup, and the event loop never runs bcrypt (`NEEDS_HASH`:
send the request to the handlers' pool). An unknown user costs a bcrypt run too, so its
timing does not tell which users exist.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import threading
from enum import Enum

from ac_observe.auth import bearer_token

REMEMBERED_MAX = 1024  # verified (user, password) pairs kept; past it the oldest leaves


class Verdict(Enum):
    ADMIT = "admit"
    MISSING = "missing"          # credentials are configured, the request carries none
    BAD = "bad"                  # it carries some that do not match
    NEEDS_HASH = "needs_hash"    # only bcrypt can tell: not on the event loop


class BasicUsers:
    """The web-config file's `basic_auth_users`: name -> bcrypt hash."""

    def __init__(self, users: dict[str, str]):
        self.users = {name.encode("utf-8"): hashed.encode("ascii")
                      for name, hashed in users.items()}
        self._remembered: dict[bytes, None] = {}  # verified keys, oldest first
        self._lock = threading.Lock()
        self._decoy: bytes | None = None

    def verdict(self, header: str, may_hash: bool) -> Verdict:
        """For an `Authorization: Basic ...` header's value."""
        pair = basic_credentials(header)
        if pair is None:
            return Verdict.BAD
        user, password = pair
        hashed = self.users.get(user)
        key = hashlib.sha256(b"\0".join((user, password, hashed or b""))).digest()
        if key in self._remembered:
            return Verdict.ADMIT
        if not may_hash:
            return Verdict.NEEDS_HASH
        import bcrypt
        if hashed is None:  # as long as a real check, so the timing tells nothing
            self._check(bcrypt, password, self._decoy_hash(bcrypt))
            ok = False
        else:
            ok = self._check(bcrypt, password, hashed)
        if not ok:  # never remembered: wrong guesses cannot push out the scrapers' logins
            return Verdict.BAD
        with self._lock:
            while len(self._remembered) >= REMEMBERED_MAX:
                self._remembered.pop(next(iter(self._remembered)))
            self._remembered[key] = None
        return Verdict.ADMIT

    @staticmethod
    def _check(bcrypt, password: bytes, hashed: bytes) -> bool:
        try:
            return bcrypt.checkpw(password, hashed)
        except ValueError:  # a password over bcrypt's 72 bytes, a malformed hash
            return False

    def _decoy_hash(self, bcrypt) -> bytes:
        if self._decoy is None:
            cost = 10
            for hashed in self.users.values():
                cost = int(hashed[4:6])
                break
            self._decoy = bcrypt.hashpw(b"ac-observe decoy", bcrypt.gensalt(cost))
        return self._decoy


def basic_credentials(header: str) -> tuple[bytes, bytes] | None:
    """(user, password) of a Basic header's value (RFC 7617), as the client's bytes."""
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    return (user, password) if sep else None


class Credentials:
    """The bearer token and the basic-auth users in force."""

    def __init__(self, token: str | None):
        self.expected = token.encode("utf-8") if token else None

    def set_token(self, token: str) -> None:
        self.expected = token.encode("utf-8")

    def configured(self, basic: BasicUsers | None) -> bool:
        return self.expected is not None or bool(basic and basic.users)

    def verdict(self, authorization: str | None, basic: BasicUsers | None,
                may_hash: bool = True) -> Verdict:
        """Whether a request with this Authorization header may in."""
        if not self.configured(basic):
            return Verdict.ADMIT
        if not authorization:
            return Verdict.MISSING
        scheme = authorization.strip().partition(" ")[0].lower()
        if scheme == "basic" and basic is not None and basic.users:
            return basic.verdict(authorization, may_hash)
        given = bearer_token(authorization)
        if given is not None and self.expected is not None and \
                hmac.compare_digest(given, self.expected):
            return Verdict.ADMIT
        return Verdict.BAD

    def challenge(self, basic: BasicUsers | None) -> str:
        """The WWW-Authenticate header of a 401: the schemes this daemon takes."""
        schemes = []
        if self.expected is not None:
            schemes.append('Bearer realm="ac-observe"')
        if basic is not None and basic.users:
            schemes.append('Basic realm="ac-observe", charset="UTF-8"')
        return ", ".join(schemes) or 'Bearer realm="ac-observe"'
