"""One command in a fresh sandbox, in one call: ``Sandbox.run_once``."""

from __future__ import annotations

from typing_extensions import Unpack  # typing's since 3.11 only

from corral.client import _validate
from corral.client._async._client import AsyncClient
from corral.client._config import CREATE_TIMEOUT, auto_tags, exec_http_timeout
from corral.client._models import (
    Command,
    CommandResult,
    SpecOptions,
    exec_body,
    parse_exec,
    spec_body,
)
from corral.schema import DEFAULT_EXEC_TIMEOUT_S, MAX_TAGS


async def run_once(
    cmd: Command,
    image: str | None = None,
    *,
    exec_timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
    stdin: bytes | str | None = None,
    cwd: str | None = None,
    user: str | None = None,
    max_output: int | None = None,
    output_tail: int | None = None,
    check: bool = False,
    client: AsyncClient | None = None,
    **spec: Unpack[SpecOptions],
) -> CommandResult:
    """Create a sandbox, run ``cmd`` in it and delete it, in one round trip to the
    daemon (``POST /v1/run``): what ``with Sandbox.create(...) as sb: sb.exec(cmd)``
    does in three. ``image`` and ``spec`` are :meth:`AsyncSandbox.create`'s (``env``
    is the sandbox's, so the command's too; ``timeout`` its lifetime);
    ``exec_timeout``, ``stdin``, ``cwd``, ``user``, ``max_output``, ``output_tail`` and
    ``check`` are :meth:`AsyncSandbox.exec`'s. The sandbox is deleted whatever the
    command did, and if this call is abandoned. Its id is the result's ``sandbox_id``.

    >>> r = await AsyncSandbox.run_once(["python3", "-c", "print(6*7)"], "python")
    >>> r.stdout
    '42\\n'
    """
    client = client or AsyncClient.default()
    body = spec_body({"image": image, **spec})
    tags = auto_tags()  # wandb-run:ID, slurm-job:ID of this process, as create does
    if tags:
        body = {**body, "tags": list(dict.fromkeys([*body.get("tags", []), *tags]))[:MAX_TAGS]}
    command = exec_body(cmd, timeout=exec_timeout, env=None, cwd=cwd, stdin=stdin,
                        max_output=max_output, output_tail=output_tail, user=user)
    _validate.flag("check", check)
    after_exec = exec_http_timeout(exec_timeout)
    timeout = None if after_exec is None else max(client.timeout, CREATE_TIMEOUT) + after_exec
    reply = (await client.call("run_once", json={"spec": body, "exec": command},
                               timeout=timeout)).json()
    result = parse_exec(reply["result"], args=cmd, sandbox_id=str(reply["sandbox_id"]),
                        timeout=exec_timeout)
    if check:
        result.check_returncode()
    return result
