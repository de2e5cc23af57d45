"""Tenant isolation through the CLI (every command that takes a sandbox id) and through
cwsandbox's exec and file calls: another tenant's sandbox answers exactly like an id
that never existed, and nothing of it changes."""

from __future__ import annotations

import pytest

import corral
from tests.security.tenants_helpers import UNKNOWN, grpc_team
from tests.security.test_tenants_sdk import _cli


@pytest.fixture(scope="module")
def team():
    with grpc_team() as t:
        yield t


@pytest.fixture
def alice_sb(team):
    with corral.Client(team.url, token=team.tokens["alice"]) as c:
        sb = corral.Sandbox.create(memory_mb=64, client=c)
        sb.files.write("/workspace/secret", b"alice's")
        yield sb
        assert sb.refresh().state.value == "running"  # untouched by bob
        assert sb.files.read("/workspace/secret") == b"alice's"
        assert [e for e in sb.logs() if e["kind"] == "command"] == []  # bob ran nothing
    team.cleanup()


def test_cli_another_tenants_sandbox_is_an_unknown_id(team, alice_sb, capsys, tmp_path):
    bob = ("--url", team.url, "--token", team.tokens["bob"])
    upload = tmp_path / "up"
    upload.write_bytes(b"bob's")
    commands = [
        ("inspect", "{id}"), ("exec", "{id}", "--", "cat", "/workspace/secret"),
        ("cp", "{id}:/workspace/secret", str(tmp_path / "stolen")),
        ("cp", str(upload), "{id}:/workspace/secret"),
        ("snapshot", "create", "{id}"), ("logs", "{id}"), ("timeout", "{id}", "1"),
        ("pause", "{id}"), ("stop", "{id}"), ("rm", "{id}"),
    ]
    code, out, _ = _cli(capsys, *bob, "ls", "--json")
    assert code == 0 and alice_sb.id not in out
    for command in commands:
        theirs = _cli(capsys, *bob, *(a.format(id=alice_sb.id) for a in command))
        unknown = _cli(capsys, *bob, *(a.format(id=UNKNOWN) for a in command))
        assert theirs[0] == unknown[0], (command, theirs, unknown)
        assert [s.replace(alice_sb.id, "ID") for s in theirs[1:]] == [
            s.replace(UNKNOWN, "ID") for s in unknown[1:]], (command, theirs, unknown)
        if command[0] != "rm":  # rm of an unknown id succeeds: idempotent
            assert theirs[0] != 0, (command, theirs)
    assert not (tmp_path / "stolen").exists()


def test_cwsandbox_exec_and_files_of_another_tenant(team, alice_sb):
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("cwsandbox")
    from cwsandbox._proto import sandbox_pb2 as pb
    from cwsandbox._proto import sandbox_pb2_grpc

    bob = (("authorization", f"Bearer {team.tokens['bob']}"),)
    with grpc.insecure_channel(team.grpc) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        calls = [
            lambda sid: stub.Exec(pb.ExecRequest(sandbox_id=sid, command=["true"]), metadata=bob),
            lambda sid: stub.ReadFile(pb.ReadFileRequest(sandbox_id=sid, path="/workspace/secret"),
                                      metadata=bob),
            lambda sid: stub.WriteFile(pb.WriteFileRequest(
                sandbox_id=sid, path="/workspace/secret", content=b"bob's"), metadata=bob),
        ]
        for sid in (alice_sb.id, UNKNOWN):
            for call in calls:
                with pytest.raises(grpc.RpcError) as caught:
                    call(sid)
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value
                assert sid in caught.value.details(), caught.value.details()
