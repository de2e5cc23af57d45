"""A DELETE replies before its sandbox's teardown is done (the cgroup, mounts, directories
and network link go in the background: ``engine.delete(wait=False)``). Red team 13:
what a tenant recreates at once must not collide with what is still being torn down,
and what it is owed (quota places, names) must be free when the reply says so.

Attacks: a sandbox recreated on a private network under the alias of one just deleted
(refused "alias taken" while the old one's link was still going, or its name answered
with the old address); a tenant at its ``max_sandboxes`` that deletes and creates in a
loop (never over, never refused); sandboxes deleted and made again at once never share
a host uid or a network link with one still being torn down.
"""

from __future__ import annotations

import socket

import pytest

import corral
from tests.security.tenants_helpers import no_traceback, team_daemon

RESOLVE = "import socket,sys;print(socket.gethostbyname(sys.argv[1]))"


@pytest.fixture(scope="module")
def team():
    with team_daemon() as t:
        t.make_token("dora", max_sandboxes=2)
        yield t
        t.cleanup()
        no_traceback(t)


def test_an_alias_is_free_again_when_the_delete_replies(team):
    """Delete the member named ``db``, create another as ``db`` at once: it gets the
    name (no "alias taken" from the teardown still under way), and a member asking for
    ``db`` reaches the new one's address, never the old."""
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        net = corral.Network.create("reuse", private=True, client=alice)
        app = corral.Sandbox.create(network="reuse", memory_mb=64, client=alice)
        db = corral.Sandbox.create(network=net.member("db"), memory_mb=64, client=alice)
        for _ in range(4):
            db.delete()
            db = corral.Sandbox.create(network=net.member("db"), memory_mb=64, client=alice)
            seen = app.exec(["python3", "-c", RESOLVE, "db"]).stdout.strip()
            mine = app.exec(["python3", "-c", RESOLVE, db.id]).stdout.strip()
            assert seen == mine and seen.count(".") == 3, (seen, mine)
        db.delete()
        app.delete()
        net.delete()


def test_a_tenant_at_its_quota_deletes_and_creates_in_a_loop(team):
    """``max_sandboxes=2``: delete one, create one, ten times: each create is
    admitted (the delete's reply freed its place: an over-quota create would wait in
    the queue), and the tenant never holds three."""
    with corral.Client(team.url, token=team.tokens["dora"]) as dora:
        boxes = [corral.Sandbox.create(memory_mb=64, client=dora) for _ in range(2)]
        for i in range(10):
            boxes[i % 2].delete()
            boxes[i % 2] = corral.Sandbox.create(memory_mb=64, client=dora)
            assert len(corral.Sandbox.list(client=dora)) == 2
        for sb in boxes:
            sb.delete()


def test_recreated_sandboxes_share_no_uid_or_link_with_one_being_torn_down(team):
    """Every sandbox made right after a delete runs as a host uid and on a network link
    of its own: none equal to another live one's (a uid or link given back before its
    teardown ended would be shared by two sandboxes at once)."""
    with corral.Client(team.url, token=team.tokens["alice"]) as alice:
        keep = [corral.Sandbox.create(network={"allow": []}, memory_mb=64, client=alice)
                for _ in range(2)]
        seen = []
        for _ in range(3):
            gone = corral.Sandbox.create(network={"allow": []}, memory_mb=64, client=alice)
            gone.delete()
            sb = corral.Sandbox.create(network={"allow": []}, memory_mb=64, client=alice)
            seen.append(sb)
            ids = [_identity(s) for s in [*keep, sb]]
            uids = [u for u, _ in ids]
            links = [g for _, g in ids]
            assert len(set(uids)) == len(uids) and len(set(links)) == len(links), ids
            sb.delete()
        for sb in keep:
            sb.delete()


def _identity(sb) -> tuple[int, str]:
    """(its host uid, its link's gateway address)."""
    uid = int(sb.exec(["sh", "-c", "cat /proc/self/uid_map"]).stdout.split()[1])
    gateway = sb.exec("cat /etc/resolv.conf").stdout.split()[1]
    socket.inet_aton(gateway)
    return uid, gateway
