"""Red team: a live checkpoint's ``processes.json`` (runtime/live_processes.py), read
back at each restore as hostile input. A FIFO in its place hung the read (on the
daemon's event loop: every request stopped); a ``NaN`` start time (``json`` takes it)
was kept as a process's start time, which no JSON reply can carry. Both are
now refused as a damaged record."""

from __future__ import annotations

import json
import os
import threading

import pytest

from corral.errors import InvalidState
from corral.runtime import live_processes


def _record(**changes) -> dict:
    base = {"id": "proc-0123456789ab", "rid": 3, "argv": ["cat"], "pid": 2, "terminal": None,
            "max_buffer": 1 << 20, "stdin_open": True, "started_at": 1.0, "unread": []}
    return {**base, **changes}


@pytest.mark.parametrize("when", ["NaN", "Infinity", "-Infinity"])
def test_a_start_time_that_is_no_number_is_refused(tmp_path, when):
    text = json.dumps([_record()]).replace('"started_at": 1.0', f'"started_at": {when}')
    (tmp_path / live_processes.FILE).write_text(text)
    with pytest.raises(InvalidState, match="record of processes"):
        live_processes.read(tmp_path)


def test_a_fifo_for_a_record_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / live_processes.FILE
    os.mkfifo(fifo)
    outcome: list[BaseException | object] = []

    def read() -> None:
        try:
            outcome.append(live_processes.read(tmp_path))
        except BaseException as exc:  # noqa: BLE001 - what the read raised is the result
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock it: a writer opens and closes the FIFO
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading a FIFO record blocked")
    assert isinstance(outcome[0], InvalidState), outcome
