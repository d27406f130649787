"""CURVE encryption and client authentication for channels that cross hosts, and the proof of the
per-run secret that every producer link gives in its hellos.

The consumer is the CURVE server. With `authorized_clients`, a process-wide ZAP handler (a
thread, so it answers even while the event loop is busy) admits only those client keys, per
channel (each receiver gets its own ZAP domain). The admitted set of a domain can change while
its socket runs (`admit` / `revoke`: a replica added or removed by `flowrl scale`); it is read at
each handshake, so a revoked key is refused from its next connection on.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from typing import Any

import zmq

from flowrl.transport.config import CurveConfig
from flowrl.transport.sockets import shared_context
from flowrl.transport.wire import NONCE_BYTES

_lock = threading.Lock()
_auth: Any = None
_allowed: dict[str, frozenset[bytes] | None] = {}


class _Provider:
    def callback(self, domain: str, key: bytes) -> bool:
        allowed = _allowed.get(domain, frozenset())
        return allowed is None or key in allowed


def apply_server(sock: Any, curve: CurveConfig | None, domain: str) -> None:
    if curve is None:
        return
    if curve.server_secret is None:
        raise ValueError("the consumer of a CURVE channel needs curve.server_secret")
    sock.curve_server = True
    sock.curve_publickey = curve.server_public.encode()
    sock.curve_secretkey = curve.server_secret.get_secret_value().encode()
    sock.zap_domain = domain.encode()
    with _lock:
        global _auth
        keys = None if curve.authorized_clients is None else frozenset(k.encode() for k in curve.authorized_clients)
        _allowed[domain] = keys
        if _auth is None:
            from zmq.auth.thread import ThreadAuthenticator

            _auth = ThreadAuthenticator(zmq.Context.shadow(shared_context().underlying))
            _auth.start()
        _auth.configure_curve_callback(domain=domain, credentials_provider=_Provider())


def admit(domain: str, keys) -> None:
    """Admit more client keys (Z85 text) on `domain` from the next handshake on."""
    with _lock:
        allowed = _allowed.get(domain, frozenset())
        if allowed is not None:
            _allowed[domain] = allowed | frozenset(k.encode() for k in keys)


def revoke(domain: str, keys) -> None:
    """Refuse these client keys on `domain` from their next handshake on (a connection already made
    stays until it drops)."""
    with _lock:
        allowed = _allowed.get(domain)
        if allowed is not None:
            _allowed[domain] = allowed - frozenset(k.encode() for k in keys)


def admitted(domain: str) -> frozenset[str] | None:
    """The keys `domain` admits now (None: any key)."""
    with _lock:
        allowed = _allowed.get(domain, frozenset())
    return None if allowed is None else frozenset(k.decode() for k in allowed)


def release(domain: str) -> None:
    with _lock:
        _allowed.pop(domain, None)
        if _auth is not None:
            _auth.credentials_providers.pop(domain, None)


def apply_client(sock: Any, curve: CurveConfig | None) -> None:
    if curve is None:
        return
    if curve.client_public is None:
        public, secret = zmq.curve_keypair()
    else:
        public, secret = curve.client_public.encode(), curve.client_secret.get_secret_value().encode()
    sock.curve_serverkey = curve.server_public.encode()
    sock.curve_publickey = public
    sock.curve_secretkey = secret


# ------------------------------------------------------------------------------- per-run secret
# A producer link proves it knows the channel's secret without sending it: the consumer derives a
# nonce from its own random key and the link's routing id (so it keeps no state for links it does
# not know yet), hands it out in a `known: false` status, and the link puts
# HMAC-SHA256(secret, label + nonce + routing id) into every hello from then on.
_PROOF_LABEL = b"flowrl-hello-v1\0"


def nonce_for(key: bytes, rid: bytes) -> bytes:
    return hmac.new(key, rid, hashlib.sha256).digest()[:NONCE_BYTES]


def proof(secret: bytes, nonce: bytes, rid: bytes) -> bytes:
    return hmac.new(secret, _PROOF_LABEL + nonce + rid, hashlib.sha256).digest()


def proof_ok(expected: bytes, given: bytes | None) -> bool:
    return given is not None and hmac.compare_digest(expected, given)
