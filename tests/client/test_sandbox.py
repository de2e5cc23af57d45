"""The blocking API end to end, against a real daemon."""

from __future__ import annotations

import subprocess

import pytest

import corral


def test_create_exec_and_delete(client):
    with corral.Sandbox.create(
        image="python", cpus=1, memory_mb=512, timeout=600, tags=["rl", "job=42"], client=client
    ) as sb:
        assert sb.id.startswith("sb-") and sb.state is corral.SandboxState.RUNNING
        assert sb.info.spec.memory_mb == 512 and sb.tags == ["rl", "job=42"]
        r = sb.exec(["python3", "-c", "print(6*7)"], timeout=10)
        assert (r.returncode, r.stdout, r.stderr, r.stdout_bytes) == (0, "42\n", "", b"42\n")
        assert r.ok and not r.timed_out and not r.oom_killed and not r.truncated
        assert 0 < r.duration < 10
        listed = corral.Sandbox.list(tags=["job=42"], state="running", client=client)
        assert sb.id in [s.id for s in listed]
        assert sb.id not in [s.id for s in corral.Sandbox.list(tags=["job=42", "nope"], client=client)]
    assert sb.id not in [s.id for s in corral.Sandbox.list(client=client)]


def test_shell_strings_env_cwd_and_stdin(client):
    with corral.Sandbox.create(env={"BASE": "b"}, client=client) as sb:
        r = sb.exec("echo $BASE-$EXTRA; pwd; cat", env={"EXTRA": "x"}, cwd="/tmp", stdin="from stdin")
        assert r.stdout == "b-x\n/tmp\nfrom stdin"
        r = sb.exec(["sh", "-c", "echo oops >&2; exit 3"])
        assert (r.returncode, r.stderr, r.ok) == (3, "oops\n", False)
        binary = sb.exec(["head", "-c", "2"], stdin=b"\xff\xfe\x00")
        assert binary.stdout_bytes == b"\xff\xfe"


def test_timeout_is_a_result_unless_checked(client):
    with corral.Sandbox.create(client=client) as sb:
        r = sb.exec("sleep 30", timeout=0.5)
        assert r.timed_out and not r.ok and r.duration < 10
        with pytest.raises(corral.ExecTimeout, match=sb.id) as info:
            sb.exec("sleep 30", timeout=0.5, check=True)
        assert info.value.result.timed_out
        with pytest.raises(subprocess.CalledProcessError) as info:
            sb.exec("echo bad >&2; exit 2", check=True)
        assert (info.value.returncode, info.value.stderr) == (2, "bad\n")
        assert sb.exec("true", check=True).returncode == 0


def test_output_is_truncated_at_max_output(client):
    with corral.Sandbox.create(client=client) as sb:
        r = sb.exec("head -c 5000 /dev/zero", max_output=1000)
        assert r.stdout_truncated and r.truncated and len(r.stdout_bytes) == 1000


def test_output_keeps_its_head_and_tail_through_the_sdk(client):
    """The SDK and the HTTP API carry the tail, the counts, and the gap in a stream."""
    out = "".join(f"{i}\n" for i in range(1, 20_001)).encode()
    with corral.Sandbox.create(client=client) as sb:
        r = sb.exec("seq 1 20000; seq 1 20000 >&2", max_output=1000, output_tail=300)
        assert r.stdout_bytes == out[:700] + out[-300:] and r.stdout_dropped == len(out) - 1000
        assert r.stderr_bytes == r.stdout_bytes and r.stderr_dropped == r.stdout_dropped
        assert r.truncated and r.output_tail == 300
        assert r.head_and_tail("stderr") == (out[:700], out[-300:])
        r = sb.exec("seq 1 20000", max_output=1000)  # the default tail: half
        assert r.stdout_bytes == out[:500] + out[-500:] and r.output_tail == 500
        r = sb.exec("seq 1 20000", max_output=1000, output_tail=0)
        assert r.stdout_bytes == out[:1000] and r.head_and_tail() == (out[:1000], b"")
        small = sb.exec("seq 1 10")
        assert small.stdout_bytes == out[:21] and not small.truncated and small.stdout_dropped == 0
        assert small.head_and_tail() == (out[:21], b"")
        with sb.exec_stream("seq 1 20000", max_output=1000, output_tail=300) as stream:
            chunks = list(stream)
        gap = [i for i, c in enumerate(chunks) if c.dropped]
        assert len(gap) == 1 and chunks[gap[0]].data == b"" and chunks[gap[0]].dropped == len(out) - 1000
        assert b"".join(c.data for c in chunks[: gap[0]]) == out[:700]
        assert b"".join(c.data for c in chunks[gap[0] + 1 :]) == out[-300:]
        assert stream.result.stdout_bytes == out[:700] + out[-300:]
        assert stream.result.stdout_dropped == len(out) - 1000


def test_exec_stream_yields_output_in_order_then_the_result(client):
    # Output of one pipe keeps its order; across stdout and stderr, the order is that
    # of arrival, so the writes are spaced out.
    script = "for i in 1 2 3; do echo out$i; sleep 0.1; echo err$i >&2; sleep 0.1; done; exit 4"
    with corral.Sandbox.create(client=client) as sb:
        stream = sb.exec_stream(script, timeout=30)
        chunks = [(c.stream, c.text) for c in stream]
        assert "".join(t for s, t in chunks if s == "stdout") == "out1\nout2\nout3\n"
        assert "".join(t for s, t in chunks if s == "stderr") == "err1\nerr2\nerr3\n"
        order = [t.strip() for _, t in chunks for t in t.splitlines(keepends=True)]
        assert order == ["out1", "err1", "out2", "err2", "out3", "err3"]
        assert stream.result.returncode == 4
        assert stream.result.stdout == "out1\nout2\nout3\n"

        with sb.exec_stream("echo a; sleep 0.2; echo b") as run:
            assert run.wait().stdout == "a\nb\n"
        with pytest.raises(subprocess.CalledProcessError):
            sb.exec_stream("exit 1", check=True).wait()


def test_leaving_a_stream_early_kills_the_command(client):
    with corral.Sandbox.create(client=client) as sb:
        with sb.exec_stream("echo started; sleep 1; touch /tmp/survived", timeout=30) as run:
            first = next(iter(run))
            assert first.text == "started\n"
        r = sb.exec("sleep 2; ls /tmp/survived", timeout=10)
        assert r.returncode != 0, "the command kept running after the stream was closed"


def test_lifecycle_refresh_connect(client):
    with corral.Sandbox.create(client=client) as sb:
        assert sb.pause().state is corral.SandboxState.PAUSED
        assert sb.refresh().state is corral.SandboxState.PAUSED
        assert sb.resume().state is corral.SandboxState.RUNNING
        assert sb.exec("echo back").stdout == "back\n"
        sb.refresh()
        assert set(sb.usage) == {"cpu_seconds", "memory_mb"}
        again = corral.Sandbox.connect(sb.id, client=client)
        assert again.id == sb.id and again.info.spec == sb.info.spec
        stopped = sb.stop(grace=0.5)
        assert stopped.state in (corral.SandboxState.STOPPED, corral.SandboxState.STOPPING)
        sb.delete()
        sb.delete()  # idempotent


def test_context_manager_deletes_after_an_exception(client):
    with pytest.raises(RuntimeError, match="reward code crashed"):
        with corral.Sandbox.create(client=client) as sb:
            sb.exec("true")
            raise RuntimeError("reward code crashed")
    with pytest.raises(corral.SandboxNotFound):
        corral.Sandbox.connect(sb.id, client=client)


def test_typed_errors(client):
    with pytest.raises(corral.SandboxNotFound, match="sb-doesnotexist") as info:
        corral.Sandbox.connect("sb-doesnotexist", client=client)
    assert isinstance(info.value, LookupError)
    with pytest.raises(corral.InvalidArgument, match="memory_mb"):
        corral.Sandbox.create(memory_mb=1, client=client)  # refused before sending
    with pytest.raises(corral.InvalidArgument, match="memory_mb"):
        client.request("POST", "/v1/sandboxes", json={"memory_mb": 1})  # and by the daemon
    with pytest.raises(corral.ImageNotFound):
        corral.Sandbox.create(image="no-such-image", client=client)
    with pytest.raises(corral.InvalidArgument):
        corral.Sandbox.list(state="sleepy", client=client)
