"""Attacks on the framing of requests on the SDK's lean path (client/_wire.py) and on
the daemon's request parser behind it (uvicorn's httptools, server/limits.py).

- A caller's own ``Content-Length``, ``Transfer-Encoding``, ``Host`` or ``Expect`` header
  was written beside the lean path's (two lengths, or a length and chunks, with a second
  request hidden in the body; an ``Expect: 100-continue`` whose interim reply the lean
  reader would have taken for the answer). Now a request that names one goes to httpx,
  which checks it against the body, as before the lean path existed.
- Kept, failed: the daemon's parser refuses every ambiguous framing a client could send
  on any transport (two lengths, a length and chunks, a signed or listed length), so no
  request is read as two; a body declared within the one-read size (server/wire.py's
  read_body) is exactly as long as declared. No daemon, no root."""

from __future__ import annotations

import httptools
import httpx
import pytest

from corral.client._wire import Encoder

HEADERS = httpx.Headers({"Authorization": "Bearer crl_x"})
SMUGGLED = b"GET /v1/tenants HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("header", [
    {"Content-Length": "0"}, {"content-length": str(len(SMUGGLED))},
    {"Transfer-Encoding": "chunked"}, {"Host": "elsewhere"}, {"Expect": "100-continue"},
    {"Connection": "close"}, {"Upgrade": "h2c"}, {"TE": "trailers"},
])
def test_a_callers_framing_header_goes_to_httpx(header):
    kwargs = {"content": SMUGGLED, "headers": header}
    assert Encoder("http://corral", HEADERS, httpx.Timeout(5)).encode(
        "POST", "/v1/x", kwargs) is None


def test_other_headers_still_take_the_lean_path():
    lean = Encoder("http://corral", HEADERS, httpx.Timeout(5)).encode(
        "POST", "/v1/x", {"content": b"{}", "headers": {"Content-Type": "application/json",
                                                         "X-Trace": "1"}})
    assert lean is not None
    assert lean.data.count(b"content-length:") == 1 and lean.data.count(b"host:") == 1


class _Sink:
    def __init__(self) -> None:
        self.messages = 0
        self.body = b""

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.messages += 1


@pytest.mark.parametrize("framing", [
    b"Content-Length: 0\r\nContent-Length: 38\r\n",
    b"Content-Length: 38\r\nContent-Length: 38\r\n",
    b"Content-Length: 38\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 38\r\n",
    b"Content-Length: +38\r\n", b"Content-Length: -1\r\n", b"Content-Length: 0, 38\r\n",
    b"Content-Length : 38\r\n", b"Transfer-Encoding: chunked, identity\r\nContent-Length: 3\r\n",
])
def test_the_daemons_parser_refuses_ambiguous_framing(framing):
    sink = _Sink()
    parser = httptools.HttpRequestParser(sink)
    with pytest.raises(httptools.HttpParserError):
        parser.feed_data(b"POST /v1/x HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n" + SMUGGLED)
    assert sink.messages == 0
