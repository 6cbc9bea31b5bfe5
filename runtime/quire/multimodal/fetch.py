"""Fetching an image an http(s) URL names, for the server, within its limits: off unless
the operator allowed it, only from the allowed hosts (each redirect's too), at most so many
bytes, redirects and seconds.

Public interface:
    MediaFetch(allow, domains, timeout, max_bytes, max_redirects)
    await MediaFetch.get(url, field) -> bytes   QuireValidationError naming the field and the
                                                reason for anything refused or failed

httpx is the client (the router's already): a redirect is followed by hand so that every
hop's host is checked against the allowed ones, and the body is read in pieces so that a
large one is cut off at max_bytes, whatever its Content-Length says.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from quire.validation import QuireValidationError

DATA_URL_HINT = "send the image inline as a data:image/...;base64 URL"


@dataclass(frozen=True)
class MediaFetch:
    allow: bool = False                       # --allow-media-fetch
    domains: tuple[str, ...] | None = None    # --allowed-media-domains (None: any host)
    timeout: float = 5.0                      # --media-fetch-timeout, for the whole fetch
    max_bytes: int = 20 << 20                 # --max-media-bytes
    max_redirects: int = 3

    @property
    def enabled(self) -> bool:
        return self.allow or bool(self.domains)

    def check_url(self, url: str, field: str) -> None:
        """The scheme and host of a URL this server may fetch."""
        if not self.enabled:
            raise QuireValidationError(
                field, f"{field}: fetching http(s) image URLs is off on this server (start "
                f"it with --allow-media-fetch or --allowed-media-domains); {DATA_URL_HINT}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise QuireValidationError(field, f"{field} must be an http(s) URL with a host, "
                                       f"or a data URL, got {url[:60]!r}")
        host = parts.hostname.lower()
        if self.domains is not None and host not in self.domains:
            raise QuireValidationError(
                field, f"{field}: the host {host!r} is not among the allowed media domains "
                f"(--allowed-media-domains: {', '.join(self.domains)})")

    async def get(self, url: str, field: str) -> bytes:
        self.check_url(url, field)
        try:
            return await asyncio.wait_for(self._get(url, field), self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise QuireValidationError(field, f"{field}: fetching the image took longer than "
                                       f"{self.timeout:g} s (--media-fetch-timeout)") from None

    async def _get(self, url: str, field: str) -> bytes:
        import httpx
        async with httpx.AsyncClient(follow_redirects=False, timeout=self.timeout) as client:
            for _ in range(self.max_redirects + 1):
                try:
                    async with client.stream("GET", url) as response:
                        if response.is_redirect:
                            url = urljoin(url, response.headers.get("location", ""))
                            self.check_url(url, f"{field} (redirected)")
                            continue
                        if response.status_code != 200:
                            raise QuireValidationError(
                                field, f"{field}: fetching the image answered HTTP "
                                f"{response.status_code}")
                        return await self._body(response, field)
                except httpx.HTTPError as e:
                    raise QuireValidationError(
                        field, f"{field}: the image could not be fetched: "
                        f"{type(e).__name__}: {e}") from None
        raise QuireValidationError(field, f"{field}: more than {self.max_redirects} redirects")

    async def _body(self, response, field: str) -> bytes:
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_big(field)
        body = bytearray()
        async for piece in response.aiter_bytes():
            body += piece
            if len(body) > self.max_bytes:
                raise self._too_big(field)
        return bytes(body)

    def _too_big(self, field: str) -> QuireValidationError:
        return QuireValidationError(field, f"{field}: the image is larger than "
                                    f"{self.max_bytes} bytes (--max-media-bytes)")
