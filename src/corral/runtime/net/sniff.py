"""The name a connection asks for: the HTTP ``Host`` header or the TLS SNI.

The proxy (:mod:`.proxy`) reads the first bytes a sandbox sends on port 80 or 443
and asks :func:`requested_name`; it answers once it is sure (a name, or that there
is none) and asks for more bytes while it cannot tell. Both parsers are bounded and
never trust a length field beyond the bytes present.
"""

from __future__ import annotations

import re
import struct

MAX_PEEK = 16 * 1024  # bytes read before deciding: a ClientHello or request head fits
MORE = object()  # need more bytes
_HOST_RE = re.compile(rb"^host:[ \t]*([^\r\n]*?)[ \t]*\r?$", re.IGNORECASE | re.MULTILINE)


def _http_host(data: bytes) -> object:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return MORE if len(data) < MAX_PEEK else None
    hosts = _HOST_RE.findall(data[:end])
    if len(hosts) != 1:  # none, or two (smuggling): no name
        return None
    host = hosts[0].strip().decode("ascii", "replace")
    if host.startswith("["):  # an IPv6 literal: no name
        return None
    return host.rsplit(":", 1)[0] if ":" in host else host


def _tls_sni(data: bytes) -> object:
    if len(data) < 5:
        return MORE
    rec_len = struct.unpack("!H", data[3:5])[0]
    if len(data) < 5 + rec_len:
        return MORE if 5 + rec_len <= MAX_PEEK else None
    body = data[5:5 + rec_len]
    try:
        if body[0] != 1:  # not a ClientHello
            return None
        i = 4 + 2 + 32  # handshake header, version, random
        i += 1 + body[i]  # session id
        i += 2 + struct.unpack("!H", body[i:i + 2])[0]  # cipher suites
        i += 1 + body[i]  # compression methods
        end = i + 2 + struct.unpack("!H", body[i:i + 2])[0]
        i += 2
        while i + 4 <= end:
            ext, n = struct.unpack("!HH", body[i:i + 4])
            i += 4
            if ext == 0:  # server_name: list length, then (type, length, name)
                if body[i + 2] != 0:
                    return None
                ln = struct.unpack("!H", body[i + 3:i + 5])[0]
                return body[i + 5:i + 5 + ln].decode("ascii")
            i += n
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def requested_name(data: bytes) -> object:
    """``data`` (the first bytes of a connection): the name it asks for (str), None
    when it names none (or is neither HTTP nor TLS), or :data:`MORE`."""
    if not data:
        return MORE
    if data[0] == 0x16:  # a TLS handshake record
        return _tls_sni(data)
    return _http_host(data)
