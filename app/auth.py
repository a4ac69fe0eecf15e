"""API keys: `Authorization: Bearer KEY` on every route but /health and /metrics.

Keys come from COMPLETIONS_API_KEY (comma-separated) and COMPLETIONS_API_KEY_FILE (one
per line, `#` comments). Comparison is constant-time and checks every key, so timing
tells nothing about how much of a key matched. Keys are never logged.
"""
from __future__ import annotations

import hmac

from flask import Flask, request

from app.errors import Unauthorized
from dispatcher.common.config import load_keys

OPEN_PATHS = {"/health", "/metrics"}     # for load balancers and Prometheus


def key_matches(candidate: bytes, keys: list[bytes]) -> bool:
    found = False
    for key in keys:                       # no early exit: every key is compared
        found |= hmac.compare_digest(candidate, key)
    return found


def init_app(app: Flask) -> None:
    keys = load_keys(str(app.config.get("API_KEY") or ""), app.config.get("API_KEY_FILE"))
    app.config["API_KEYS_ENABLED"] = bool(keys)
    # keys are tenants: each reuses only the prompt cache it filled, unless told otherwise
    app.config["CACHE_SCOPE"] = app.config.get("CACHE_SCOPE") or ("key" if keys else "shared")
    if not keys:
        return

    @app.before_request
    def require_key():
        if request.path in OPEN_PATHS:
            return None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key_matches(token.strip().encode(), keys):
            raise Unauthorized("Missing or invalid API key: send 'Authorization: Bearer "
                               "<key>'.", headers={"WWW-Authenticate": "Bearer"})
        return None
