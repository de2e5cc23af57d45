"""SandboxFusion's ``/submit`` with provided stdin/stdout tests, judged by corral's
judge (corral.server.compat.sandboxfusion_submit), through the real ``sandbox_fusion``
client; ``run_code`` is untouched (tests/server/test_compat_sandboxfusion.py)."""

from __future__ import annotations

import pytest

from tests.server.test_compat_sandboxfusion import checked, run_script, serving

pytest.importorskip("sandbox_fusion", reason="the compat extra (sandbox-fusion) is not installed")

SUBMIT = """
from sandbox_fusion import SubmitRequest, TestConfig, submit
def judge(completion, language, tests):
    req = SubmitRequest(dataset="mine", id=7, completion=completion, config=TestConfig(
        language=language, run_timeout=6,  # right programs run within it, loaded
        provided_data={"test": [{"input": {"stdin": i}, "output": {"stdout": o}} for i, o in tests]}))
    return submit(req, endpoint=os.environ["SANDBOX_FUSION_ENDPOINT"], max_attempts=1).dict()
"""


@pytest.fixture(scope="module")
def sf_daemon():
    with serving() as d:
        yield d


def test_submit_judges_provided_stdio_tests_in_several_languages(sf_daemon):
    with checked(sf_daemon) as d:
        out = run_script(d, SUBMIT + """
tests = [("1 2\\n", "3\\n"), ("40 2\\n", "42\\n")]
out["py"] = judge("```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```", "python", tests)
out["cpp"] = judge("Here:\\n```cpp\\n#include <iostream>\\nint main(){long a,b;std::cin>>a>>b;"
                   "std::cout<<a+b;}\\n```", "cpp", tests)
out["wrong"] = judge("```python\\nprint(3)\\n```", "python", tests)
out["loop"] = judge("```python\\nwhile True: pass\\n```", "python", tests[:1])
""")
    py, cpp, wrong, loop = out["py"], out["cpp"], out["wrong"], out["loop"]
    if py["extra"].get("status") == "SandboxError":
        pytest.skip("the judge built-in image is not built (make install)")
    assert py["accepted"] and py["extracted_type"] == "fenced", py
    assert [t["passed"] for t in py["tests"]] == [True, True]
    assert cpp["accepted"] and cpp["extra"]["verdicts"] == ["AC", "AC"], cpp
    assert not wrong["accepted"] and wrong["extra"]["verdicts"] == ["AC", "WA"], wrong
    assert loop["extra"]["verdicts"] == ["TLE"], loop
    assert "42" not in str(wrong["tests"][1]["exec_info"])  # the expected output is not echoed
