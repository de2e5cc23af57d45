"""Attack on the output budget (runtime/output_budget.py) through the E2B front-end's
download as root (``GET /files?username=root``): the file is read by ``cat`` run as
root, its whole content kept in the daemon until the reply is written. The command
reserved its room only while it ran and gave it back as it returned, so a client
asking for a large file again and again without reading the replies made the daemon
hold every copy, past the budget (here 80 MiB, four 32 MiB files: 128 MiB held).
Now the room is held until the reply is written, as a native exec's result is: the
second download finds too little left and is refused, typed (429
``output_budget_exceeded``), and room comes back as the replies are read."""

from __future__ import annotations

import pytest

from tests.server.test_compat_e2b import checked, run_script, serving

SIZE = 32 << 20


@pytest.fixture(scope="module")
def e2b():
    with serving("--output-memory-mb", "80", "--tenant-output-memory-mb", "80") as d:
        yield d


def test_downloads_as_root_not_read_hold_their_room_in_the_output_budget(e2b):
    with checked(e2b) as d:
        out = run_script(d, f"""
            import socket, urllib.parse
            with Sandbox.create() as sb:
                sb.commands.run("head -c {SIZE} /dev/zero > /tmp/big", timeout=60)
                url = urllib.parse.urlsplit(sb.envd_api_url)
                head = ("GET /files?path=/tmp/big&username=root HTTP/1.1\\r\\n"
                        f"Host: {{url.netloc}}\\r\\nE2b-Sandbox-Id: {{sb.sandbox_id}}\\r\\n"
                        f"X-Access-Token: {{sb._envd_access_token}}\\r\\n\\r\\n").encode()
                held, out["status"] = [], []
                for _ in range(4):  # each reply left unread: its body stays in flight
                    s = socket.create_connection((url.hostname, url.port), timeout=120)
                    s.sendall(head)
                    got = b""
                    while len(got) < 12 and (more := s.recv(12 - len(got))):
                        got += more
                    out["status"].append(got.decode())
                    held.append(s)
                for s in held:
                    s.close()
                # the room came back: a download read whole gets the whole file
                out["after"] = len(sb.files.read("/tmp/big", format="bytes", user="root"))
        """)
    status = out["status"]
    assert status[0] == "HTTP/1.1 200", status
    assert "HTTP/1.1 429" in status[1:], status  # 200 each: 128 MiB held for 80
    assert out["after"] == SIZE
