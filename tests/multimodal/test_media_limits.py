"""The image limits (--limit-mm-per-prompt, --max-image-pixels) and the http(s) fetcher's
(--allow-media-fetch, --allowed-media-domains, bytes, redirects, time), against a real HTTP
server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time

import pytest
from PIL import Image

from quire.config import EngineArgs
from quire.multimodal.fetch import MediaFetch
from quire.multimodal.images import image_from_bytes, image_from_url
from quire.multimodal.limits import parse_limit_mm_per_prompt
from quire.validation import QuireValidationError

from mm_helpers import random_image


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("value,expected", [
    (None, {"image": 4}), ('{"image": 2}', {"image": 2}), ("image=0", {"image": 0}),
    ({"image": 7}, {"image": 7})])
def test_limit_mm_per_prompt_spellings(value, expected):
    assert parse_limit_mm_per_prompt(value) == expected


@pytest.mark.parametrize("value,words", [
    ('{"video": 1}', "names 'video'"), ("image=x", "image=4"), ('{"image": -1}', ">= 0"),
    ("{nope", "not valid JSON"), ('{"image": true}', ">= 0")])
def test_limit_mm_per_prompt_refusals_name_the_flag(value, words):
    with pytest.raises(QuireValidationError, match="limit_mm_per_prompt") as e:
        EngineArgs(limit_mm_per_prompt=value)
    assert words in str(e.value)
    assert e.value.field == "limit_mm_per_prompt"


def test_pixel_limit_is_read_from_the_header(monkeypatch):
    """An 8000 x 8000 PNG is refused before its 64 M pixels are decoded (load never runs)."""
    data = png(Image.new("L", (8000, 8000)))
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(1))
    with pytest.raises(QuireValidationError, match=r"8000x8000 = 64000000 pixels; at most "
                       r"16777216 .*--max-image-pixels") as e:
        image_from_bytes(data, "messages[0].content[0].image_url.url")
    assert e.value.field == "messages[0].content[0].image_url.url"
    assert not loads


@pytest.mark.parametrize("url,words", [
    ("data:image/png;base64,!!!!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"plain text").decode(), "is not an image"),
    ("data:image/png,rawdata", "base64-encoded"),
    ("file:///etc/passwd", "must be a data:image"),
])
def test_bad_data_urls_name_the_field(url, words):
    with pytest.raises(QuireValidationError, match=words) as e:
        image_from_url(url, "x.url")
    assert e.value.field == "x.url"


# --- fetching -----------------------------------------------------------------------------
IMAGE = png(random_image(3))
BIG = b"\0" * 5000


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        path = self.path
        if path == "/image.png":
            self._send(IMAGE)
        elif path.startswith("/redirect-to/"):
            self.send_response(302)
            self.send_header("Location", "http://" + path.removeprefix("/redirect-to/"))
            self.end_headers()
        elif path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
        elif path == "/big":
            self._send(BIG)
        elif path == "/big-chunked":  # no Content-Length: cut off while reading
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(5):
                self.wfile.write(b"3e8\r\n" + b"\0" * 1000 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/slow":
            time.sleep(3)
            self._send(IMAGE)
        else:
            self.send_response(404)
            self.end_headers()

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def origin():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fetch(fetcher: MediaFetch, url: str) -> bytes:
    return asyncio.run(fetcher.get(url, "part.url"))


ALLOWED = MediaFetch(domains=("127.0.0.1",), timeout=1.5, max_bytes=4000, max_redirects=2)


def test_fetch_from_an_allowed_host(origin):
    assert fetch(ALLOWED, f"http://{origin}/image.png") == IMAGE
    assert fetch(MediaFetch(allow=True), f"http://{origin}/image.png") == IMAGE
    # a redirect within the allowed hosts is followed
    assert fetch(ALLOWED, f"http://{origin}/redirect-to/{origin}/image.png") == IMAGE


@pytest.mark.parametrize("fetcher,path,words", [
    (MediaFetch(), "/image.png", "fetching http(s) image URLs is off"),
    (MediaFetch(domains=("example.com",)), "/image.png",
     "host '127.0.0.1' is not among the allowed media domains"),
    (ALLOWED, "/redirect-to/localhost:1/image.png", "host 'localhost' is not among"),
    (ALLOWED, "/loop", "more than 2 redirects"),
    (ALLOWED, "/big", "larger than 4000 bytes"),
    (ALLOWED, "/big-chunked", "larger than 4000 bytes"),
    (ALLOWED, "/slow", "longer than 1.5 s"),
    (ALLOWED, "/missing", "answered HTTP 404"),
])
def test_fetch_refusals_name_the_part_and_the_reason(origin, fetcher, path, words):
    with pytest.raises(QuireValidationError) as e:
        fetch(fetcher, f"http://{origin}{path}")
    assert words in str(e.value)
    assert e.value.field.startswith("part.url")


def test_fetch_refuses_other_schemes_and_unreachable_hosts():
    with pytest.raises(QuireValidationError, match="must be an http"):
        fetch(MediaFetch(allow=True), "ftp://127.0.0.1/x.png")
    with pytest.raises(QuireValidationError, match="could not be fetched"):
        fetch(MediaFetch(allow=True, timeout=2), "http://127.0.0.1:1/x.png")
