"""Who may use the console, and the headers and tokens that keep a browser safe on it.

* An access token, if set, must come with every request: ``Authorization: Bearer``, or
  the session cookie the ``/login`` form sets (HttpOnly, SameSite=Strict).
* Behind an authenticating proxy (``user_header``), that header names the person, and a
  request without it is refused.
* Every form carries a CSRF token: a random per-browser cookie echoed in a hidden field
  (double submit); a POST must also come from the console's own pages by
  ``Sec-Fetch-Site`` or, without it, ``Origin``.
* Every response forbids framing, sniffing and every script but the page's own, which
  carries a nonce made for that response.

All comparisons of secrets take constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from starlette.datastructures import FormData, MutableHeaders
from starlette.requests import HTTPConnection, Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSRF_COOKIE = "polyloop_csrf"
CSRF_FIELD = "csrf"
SESSION_COOKIE = "polyloop_session"
CONTEXT_KEY = "polyloop.console"
TOKEN_ENV = "POLYLOOP_CONSOLE_TOKEN"
MIN_TOKEN_CHARS = 16
# A form holds a few short fields; anything bigger is not one of ours.
MAX_FORM_FIELDS = 16
MAX_FORM_PART_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Access:
    """How the console lets people in: an access token, a proxy's user header, or
    neither (a loopback address only); ``read_only`` takes every form away."""

    token: str | None = None
    user_header: str | None = None
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class Context:
    """What one request carries through the console: its script nonce, the CSRF token
    its forms echo, and the person the proxy named (``None`` without a user header)."""

    nonce: str
    csrf: str
    user: str | None


class Refused(Exception):
    """A request the console will not serve: the status and the one line it says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def context(request: HTTPConnection) -> Context:
    found: Context = request.scope[CONTEXT_KEY]
    return found


def exposure_problem(host: str, access: Access) -> str | None:
    """Why the console must not listen on ``host`` as set up, or ``None`` if it may.

    A loopback address reaches only this machine; any other needs a token or a proxy
    that authenticates people.
    """
    if is_loopback(host) or access.token is not None or access.user_header is not None:
        return None
    return (
        f"refusing to serve on {host}, which other machines can reach, without an access "
        f"token: give one with --token-file FILE or ${TOKEN_ENV}, or put the console behind "
        "a proxy that authenticates people and pass the header naming them with "
        "--user-header (such as X-Forwarded-User)"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def session_value(token: str) -> str:
    """What the login cookie holds: derived from the token, never the token itself."""
    return hmac.new(token.encode(), b"polyloop console session", hashlib.sha256).hexdigest()


def same_secret(given: str | None, expected: str) -> bool:
    if not given:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def authorized(request: HTTPConnection, token: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and same_secret(given.strip(), token):
        return True
    return same_secret(request.cookies.get(SESSION_COOKIE), session_value(token))


def security_headers(nonce: str) -> dict[str, str]:
    policy = (
        "default-src 'none'; "
        f"script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        "connect-src 'self'; img-src 'self'; form-action 'self'; base-uri 'none'; "
        "frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "Cache-Control": "no-store",
    }


def cookie_header(name: str, value: str, *, secure: bool) -> str:
    flags = "; Secure" if secure else ""
    return f"{name}={value}; Path=/; HttpOnly; SameSite=Strict{flags}"


class Guard:
    """ASGI middleware: lets in whom :class:`Access` allows and sets the safety headers."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        connection = HTTPConnection(scope)
        nonce = secrets.token_urlsafe(16)
        given_csrf = connection.cookies.get(CSRF_COOKIE, "")
        fresh_csrf = None if len(given_csrf) >= 32 else secrets.token_urlsafe(32)
        secure = scope.get("scheme") == "https"

        async def send_guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in security_headers(nonce).items():
                    headers[name] = value
                if fresh_csrf is not None:
                    headers.append(
                        "set-cookie", cookie_header(CSRF_COOKIE, fresh_csrf, secure=secure)
                    )
            await send(message)

        try:
            user = self._user(connection)
            self._check_token(connection)
        except Refused as refused:
            await self._refusal(connection, refused)(scope, receive, send_guarded)
            return
        scope[CONTEXT_KEY] = Context(nonce, fresh_csrf or given_csrf, user)
        await self.app(scope, receive, send_guarded)

    def _user(self, connection: HTTPConnection) -> str | None:
        name = self.access.user_header
        if name is None:
            return None
        user = connection.headers.get(name, "").strip()
        if not user:
            raise Refused(403, f"forbidden: the request carries no {name} header")
        return user

    def _check_token(self, connection: HTTPConnection) -> None:
        token = self.access.token
        if token is None or connection.url.path == "/login" or authorized(connection, token):
            return
        raise Refused(401, "an access token is needed: log in at /login")

    def _refusal(self, connection: HTTPConnection, refused: Refused) -> Response:
        if refused.status == 401 and connection.scope["method"] in ("GET", "HEAD"):
            target = asked_path(connection)
            if connection.url.query:
                target += "?" + connection.url.query
            return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)
        return PlainTextResponse(refused.message + "\n", status_code=refused.status)


def asked_path(connection: HTTPConnection) -> str:
    """The path as the browser sent it, still encoded: the server's decoded path would
    turn a run page's ``%252E`` into ``%2E``, which a browser reads as ``.``."""
    raw = connection.scope.get("raw_path")
    if isinstance(raw, bytes):
        return raw.decode("ascii", "replace")
    return quote(connection.scope["path"].encode("utf-8", "surrogatepass"), safe="/")


def local_target(target: str | None) -> str:
    """Where to go after logging in: a path of this console, never another site."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


async def checked_form(request: Request) -> FormData:
    """The POSTed form, once it proved it came from the console's own page: from this
    origin, with the browser's CSRF token echoed. :class:`Refused` (403) otherwise,
    before anything is written."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise Refused(403, f"forbidden: a form sent from another site ({site})")
    origin = request.headers.get("origin")
    if (
        site is None
        and origin is not None
        and urlsplit(origin).netloc != request.headers.get("host", "")
    ):
        raise Refused(403, "forbidden: a form sent from another origin")
    form = await request.form(
        max_files=0, max_fields=MAX_FORM_FIELDS, max_part_size=MAX_FORM_PART_BYTES
    )
    echoed = form.get(CSRF_FIELD)
    cookie = request.cookies.get(CSRF_COOKIE, "")
    if not isinstance(echoed, str) or len(cookie) < 32 or not same_secret(echoed, cookie):
        raise Refused(403, "forbidden: the form's CSRF token is missing or wrong; reload the page")
    return form


def form_text(form: FormData, name: str) -> str:
    value: Any = form.get(name, "")
    return value if isinstance(value, str) else ""
