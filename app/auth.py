"""API keys: `Authorization: Bearer KEY` on every route but /health and /metrics.

Keys come from COMPLETIONS_API_KEY (comma-separated) and COMPLETIONS_API_KEY_FILE (one
per line, `#` comments, each optionally followed by its name). Operator keys
(COMPLETIONS_OPERATOR_KEY), where given, alone read the operator routes when a key is
asked for there (--status-access), and make no completions. Comparison is
constant-time and checks every key, so timing tells nothing about how much of a key
matched. Keys are never logged; a request's key is known further on only by its name
(`TENANT`: usage per key, app.access).
"""
from __future__ import annotations

import hashlib
import hmac

from flask import Flask, current_app, request

from app.errors import Unauthorized
from dispatcher.common.apikeys import load_named_keys

# for load balancers; the status page's files (no data: the page sends the key typed into
# it, for its JSON and its playground)
OPEN_PATHS = {"/health", "/v1/health", "/", "/ui/", "/ui/status.js", "/ui/status.css"}
# what operators read, no request content: /metrics (Prometheus) and the page's JSON, as
# --status-access says: open, loopback (the default: open to a client on this host that
# came straight, not through a proxy; keyed otherwise) or key
OPERATOR_PATHS = {"/metrics", "/v1/status"}
LOOPBACK = {"127.0.0.1", "::1"}
PROXY_HEADERS = ("X-Forwarded-For", "X-Real-IP", "Forwarded")


def operator_open(access: str) -> bool:
    """Whether this request to an operator path needs no key under `access`."""
    if access == "open":
        return True
    if access == "loopback":
        # (and asked for by a loopback name: a page a browser on this host loaded from
        # elsewhere, its name rebound to 127.0.0.1, sends its own name as Host)
        return request.remote_addr in LOOPBACK and \
            not any(request.headers.get(h) for h in PROXY_HEADERS) and \
            _host_name(request.host) in LOOPBACK_NAMES
    return False


LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def client_address(req) -> str:
    """Who sent the request: its peer's address, or behind a proxy on this host (nginx)
    the last address X-Forwarded-For names, the one that proxy saw; a direct client's
    own X-Forwarded-For is not believed."""
    address = req.remote_addr or ""
    forwarded = req.headers.get("X-Forwarded-For")
    if forwarded and address in LOOPBACK:
        address = forwarded.rsplit(",", 1)[-1].strip()[:64]
    return address


def _host_name(host: str) -> str:
    """The Host header's name, its port and an IPv6 address's brackets left off."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
TENANT = "completions.tenant"            # the environ key of the request's key's name


def matching_key(candidate: bytes, keys: list[bytes]) -> int | None:
    """The index of the key `candidate` is (None: none), every key compared."""
    found = None
    for i, key in enumerate(keys):         # no early exit: every key is compared
        if hmac.compare_digest(candidate, key):
            found = i
    return found


def init_app(app: Flask) -> None:
    named = load_named_keys(str(app.config.get("API_KEY") or ""),
                            app.config.get("API_KEY_FILE"))
    keys, names = [key for key, _ in named], [name for _, name in named]
    operators = [k.strip().encode() for k in app.config.get("OPERATOR_KEYS") or []
                 if k.strip()]
    app.config["API_KEYS_ENABLED"] = bool(keys)
    app.config["API_KEY_COUNT"] = len(set(keys))    # (shares between keys: several only)
    # keys are tenants: each reuses only the prompt cache it filled, unless told otherwise
    app.config["CACHE_SCOPE"] = app.config.get("CACHE_SCOPE") or ("key" if keys else "shared")
    if not keys and not operators:
        return
    access = str(app.config.get("STATUS_ACCESS") or "loopback")

    def bearer() -> bytes:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return token.strip().encode() if scheme.lower() == "bearer" else b""

    @app.before_request
    def require_key():
        if request.path in OPEN_PATHS or (request.path in OPERATOR_PATHS
                                          and operator_open(access)):
            return None
        if request.path in OPERATOR_PATHS and operators:
            # (an operator's key, not a tenant's: with API keys alone any key read every
            # key's usage and cache hits there)
            if matching_key(bearer(), operators) is None:
                raise Unauthorized("Missing or invalid operator key: send 'Authorization: "
                                   "Bearer <operator key>'.",
                                   headers={"WWW-Authenticate": "Bearer"})
            return None
        if not keys:
            return None
        found = matching_key(bearer(), keys)
        if found is None:
            raise Unauthorized("Missing or invalid API key: send 'Authorization: Bearer "
                               "<key>'.", headers={"WWW-Authenticate": "Bearer"})
        request.environ[TENANT] = names[found]
        return None


def api_key_fingerprint(req) -> str | None:
    """The API key the request was admitted with, as a fingerprint (None: no keys are
    configured): what sessions and, with --cache-scope key, the prompt cache are
    partitioned by."""
    if not current_app.config.get("API_KEYS_ENABLED"):
        return None
    _, _, token = req.headers.get("Authorization", "").partition(" ")
    return hashlib.sha256(token.strip().encode()).hexdigest()[:16]
