"""Red-team: a dataset row is input too. LiveCodeBench's packed test cases (base64 of
zlib of a pickled JSON string) must neither run code when read (pickle) nor unpack
without bound (a zip bomb), and each refusal is a typed error naming what to do."""

from __future__ import annotations

import base64
import json
import pickle
import zlib

import pytest

from corral.errors import InvalidArgument
from corral.rl.datasets import MAX_UNPACKED_BYTES, from_livecodebench, load_tasks

CASES = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]


def packed(obj, protocol=pickle.DEFAULT_PROTOCOL):
    return base64.b64encode(zlib.compress(pickle.dumps(obj, protocol=protocol))).decode()


def row(private):
    return {"question_id": "q", "private_test_cases": private}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickled_json_string_is_read_in_every_protocol(protocol):
    task = from_livecodebench(row(packed(json.dumps(CASES), protocol)))
    assert [(c.input, c.output) for c in task.tests] == [("1 2\n", "3\n")]


class Evil:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('/tmp/corral-owned').touch()",))


@pytest.mark.parametrize("obj", [Evil(), CASES, ["a", "b"]], ids=["reduce", "list", "two-strings"])
def test_anything_but_one_pickled_string_is_refused_unrun(obj, tmp_path):
    with pytest.raises(InvalidArgument, match="pickled object"):
        from_livecodebench(row(packed(obj)))


def test_a_zip_bomb_stops_at_the_limit():
    bomb = base64.b64encode(zlib.compress(b"\0" * (64 << 20), 9)).decode()  # 64 KiB packed
    with pytest.raises(InvalidArgument, match=r"max_unpacked_bytes=1048576") as err:
        load_tasks([row(bomb)], "livecodebench", max_unpacked_bytes=1 << 20)
    assert err.value.details["limit"] == 1 << 20
    with pytest.raises(InvalidArgument, match="not a valid pickle"):  # under the default
        load_tasks([row(bomb)], "livecodebench")
    assert MAX_UNPACKED_BYTES > 64 << 20


@pytest.mark.parametrize("junk", ["%%%", base64.b64encode(b"not zlib").decode(),
                                  base64.b64encode(zlib.compress(b"\x80\x04junk")).decode()])
def test_junk_is_a_typed_error(junk):
    with pytest.raises(InvalidArgument, match="private_test_cases"):
        from_livecodebench(row(junk))
