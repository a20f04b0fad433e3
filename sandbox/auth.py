"""Authentication of a sandbox node: one shared bearer token, and where it may come from.

Owns the token's sources (a file or an environment variable, never the command line, where
``ps`` and shell history would show it), the rule that a node bound to anything but loopback
must have one, and the check itself (an aiohttp middleware comparing in constant time with
``hmac.compare_digest``). Does not own routes or metrics (``sandbox.server``).

Policy, per route (the client sends ``Authorization: Bearer <token>`` on every request):

- ``POST /v1/execute``: token required. Missing or wrong: HTTP 401 before the body is read;
  nothing is decoded, queued or executed.
- ``GET /metrics``: token required. Call counts, rejection counts and queue depth describe
  the training run's traffic; Prometheus sends a bearer token (``authorization`` /
  ``bearer_token_file`` in its scrape config), so guarding it costs an operator nothing.
- ``GET /health``: open to a request that carries *no* credentials, so load balancers and
  orchestrator probes need no secret; such a caller sees only ``status``, ``isolation`` and
  ``auth`` ("token" or "none": what a probe and a client choosing nodes need), not worker
  pids, queue or notes. A request
  that carries a token gets the full body if it is right, and 401 if it is wrong: a client
  with a bad token learns at start-up, not at its first call.

Every refusal is counted (``sandbox_http_rejected_auth_missing_total`` /
``..._auth_wrong_total``). A node with no token configured (loopback only) accepts everything,
as before. The token is a shared secret of the cluster: it authenticates callers, it does not
encrypt (put the nodes on a private network, or TLS in front, if the network is not trusted).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .errors import SandboxConfigError

DEFAULT_TOKEN_ENV = "SANDBOX_TOKEN"
MIN_TOKEN_CHARS = 16
OPEN_WITHOUT_CREDENTIALS = frozenset({"/health", "/healthz"})
PUBLIC_HEALTH_KEYS = ("status", "isolation", "auth")


def load_token(token_file: str | None = None, token_env: str | None = DEFAULT_TOKEN_ENV,
               *, environ: dict[str, str] | os._Environ[str] | None = None) -> str | None:
    """The shared token: from ``token_file`` if given (it must exist and hold one), else from
    the environment variable ``token_env`` if set, else ``None``. Surrounding whitespace (the
    file's trailing newline) is dropped. A token shorter than 16 characters is refused."""
    env = os.environ if environ is None else environ
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SandboxConfigError(f"sandbox token file {token_file!r}: {exc}") from None
        where = f"token file {token_file!r}"
    elif token_env and env.get(token_env):
        token = env[token_env].strip()
        where = f"environment variable {token_env}"
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise SandboxConfigError(f"sandbox token from {where} is {len(token)} characters; use "
                                 f"at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise SandboxConfigError(f"sandbox token from {where} has whitespace or control "
                                 "characters; it must fit in one HTTP header")
    return token


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes the node only to this machine. Names are resolved;
    an empty host or a wildcard (0.0.0.0, ::) is not loopback."""
    if host in ("", "*"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def require_token_for(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token."""
    if token is None and not is_loopback(host):
        raise SandboxConfigError(
            f"refusing to bind {host!r} without an auth token: the endpoint runs arbitrary "
            f"code. Put a token in a file (--token-file) or in ${DEFAULT_TOKEN_ENV} "
            "(--token-env names another variable), and give clients the same token")


def bearer(token: str) -> dict[str, str]:
    """The request header a client sends."""
    return {"Authorization": f"Bearer {token}"}


def check(header: str | None, token_bytes: bytes) -> str:
    """``"ok"``, ``"missing"`` or ``"wrong"`` for an Authorization header value. The
    comparison of the secret is constant-time in its content."""
    if not header:
        return "missing"
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return "wrong"
    ok = hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token_bytes)
    return "ok" if ok else "wrong"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# request[AUTH_RESULT_KEY]: "ok" | "missing" | "none" (no token set); a typed key where this
# aiohttp has them (3.12+), a plain string before
AUTH_RESULT_KEY: Any = (web.RequestKey("sandbox_auth", str) if hasattr(web, "RequestKey")
                        else "sandbox_auth")


def middleware(token: str | None, on_reject: Callable[[str], None],
               reject: Callable[[int, str, str, str | None], web.Response]) -> Callable:
    """The aiohttp middleware enforcing the policy above; ``on_reject(kind)`` counts a
    refusal and ``reject(status, kind, reason, content_type)`` builds the answer."""
    token_bytes = token.encode() if token is not None else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token_bytes is None:
            request[AUTH_RESULT_KEY] = "none"
            return await handler(request)
        verdict = check(request.headers.get("Authorization"), token_bytes)
        if verdict == "missing" and request.path in OPEN_WITHOUT_CREDENTIALS:
            request[AUTH_RESULT_KEY] = "missing"
            return await handler(request)
        if verdict != "ok":
            on_reject(f"auth_{verdict}")
            return reject(401, "unauthorized", f"{verdict} bearer token",
                          request.headers.get("Content-Type"))
        request[AUTH_RESULT_KEY] = "ok"
        return await handler(request)

    return auth
