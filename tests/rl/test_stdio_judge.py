"""The stdin/stdout judge (corral.rl.stdio, docs/grading.md) in every language, on the
``judge`` built-in image: each verdict from a real program, floats, checkers, modes."""

from __future__ import annotations

import pytest

import corral
from corral.errors import InvalidArgument
from corral.rl.stdio import extract_program, language_name, normalize_io_tests, run_io_tests
from tests.conftest import requires_root
from tests.rl.stdio_programs import PROGRAMS, SUM_TESTS

pytestmark = requires_root


@pytest.fixture(scope="module")
def judge_sb(daemon):
    with corral.Client(daemon.url) as client:
        try:
            sb = corral.Sandbox.create(client=client, image="judge", memory_mb=1536)
        except corral.errors.ImageNotFound:
            pytest.skip("the judge built-in image is not built (make install)")
        with sb:
            yield sb


@pytest.mark.parametrize("language", sorted(PROGRAMS))
def test_every_verdict_in_every_language(judge_sb, language):
    for verdict, code in PROGRAMS[language].items():
        r = run_io_tests(judge_sb, SUM_TESTS, code=code, language=language, time_limit=1,
                         memory_mb=128)
        assert r.status == "ok", (language, verdict, r.reason, r.result)
        want = [verdict] * len(SUM_TESTS)
        assert r.verdicts == want, (language, verdict, r.verdicts, r.errors, r.load_error)
        if verdict == "CE":
            assert r.compile_error and len(r.compile_error) <= 4000
            assert r.fraction == 0.0
        if verdict == "AC":
            assert r.all_passed and r.fraction == 1.0


def test_comparisons_floats_and_modes(judge_sb):
    code = "import sys\nx = float(sys.stdin.read())\nprint(x / 3)\nprint('  done  ')\n"
    tests = {"inputs": ["1\n", "2\n"], "outputs": ["0.3333333\ndone\n", "0.6666667 done"]}
    floats = run_io_tests(judge_sb, tests, code=code, compare="float", tolerance=1e-6)
    assert floats.verdicts == ["AC", "AC"], floats.errors
    tokens = run_io_tests(judge_sb, tests, code=code, compare="tokens")
    assert tokens.verdicts == ["WA", "WA"]
    lines = run_io_tests(judge_sb, [{"input": "3", "output": "1.0\n  done\n\n"}], code=code,
                         compare="lines")
    assert lines.verdicts == ["AC"]
    exact = run_io_tests(judge_sb, [{"input": "3", "output": "1.0\n  done\n\n"}], code=code,
                         compare="exact")
    assert exact.verdicts == ["WA"]
    first = run_io_tests(judge_sb, [{"input": "3", "output": "9"}] + [{"input": "3", "output": "1 done"}],
                         code=code, stop_on_failure=True)
    assert first.verdicts == ["WA", "SKIP"]


def test_a_python_checker_and_a_testlib_style_checker_program(judge_sb):
    # Any factorisation of n is right: only a checker can say so.
    code = "n = int(input())\nprint(2, n // 2)\n"
    py_checker = {"kind": "python", "source": (
        "def check(input, output, expected):\n"
        "    a, b = map(int, output.split())\n"
        "    return a * b == int(input) and a > 1 and b > 1\n")}
    tests = [{"input": "10\n", "output": "5 2\n"}, {"input": "9\n", "output": "3 3\n"}]
    r = run_io_tests(judge_sb, tests, code=code, checker=py_checker)
    assert r.verdicts == ["AC", "WA"], r.errors
    program = {"kind": "program", "language": "c", "source": (
        "#include <stdio.h>\nint main(int c,char**v){FILE*i=fopen(v[1],\"r\"),*o=fopen(v[2],\"r\");"
        "long n,a,b;fscanf(i,\"%ld\",&n);if(fscanf(o,\"%ld %ld\",&a,&b)!=2)return 2;"
        "return (a*b==n&&a>1&&b>1)?0:1;}\n")}
    r = run_io_tests(judge_sb, tests, code=code, checker=program)
    assert r.verdicts == ["AC", "WA"], r.errors
    broken = run_io_tests(judge_sb, tests, code=code,
                          checker={"kind": "python", "source": "def check(i, o, e):\n    return 1 / 0\n"})
    assert broken.verdicts == ["IE", "IE"] and broken.ungradable == [0, 1]


# A checker program speaking testlib's exit codes (testlib.h's defaults): the program
# echoes its input, the checker answers with the code that word names.
TESTLIB_LIKE = {"kind": "program", "language": "c", "max_points": 4, "source": (
    "#include <stdio.h>\n#include <string.h>\n"
    "int main(int c,char**v){char w[16]={0};FILE*o=fopen(v[2],\"r\");fscanf(o,\"%15s\",w);"
    "const char*k[]={\"ok\",\"wa\",\"pe\",\"fail\",\"dirt\",\"eof\"};int x[]={0,1,2,3,4,8};"
    "for(int i=0;i<6;i++)if(!strcmp(w,k[i])){fprintf(stderr,\"said %s\",w);return x[i];}"
    "if(!strcmp(w,\"half\")){fprintf(stderr,\"points 2 half of it\");return 7;}"
    "if(!strcmp(w,\"much\")){fprintf(stderr,\"points 9\");return 7;}"
    "return 7;}\n")}


def test_testlib_exit_codes_and_partial_credit(judge_sb):
    words = ["ok", "wa", "pe", "dirt", "eof", "half"]
    tests = [{"input": w, "output": "ok"} for w in words]
    code = "print(input())"
    r = run_io_tests(judge_sb, tests, code=code, checker=TESTLIB_LIKE)
    assert r.verdicts == ["AC", "WA", "PE", "PE", "PE", "PC"], r.errors
    assert r.case_scores == (1.0, 0, 0, 0, 0, 0.5) and r.fraction == 1.5 / 6
    assert "said wa" in r.errors[1] and "presentation error: said pe" in r.errors[2]
    # FAIL is the checker's own failure: not gradable, with its message; so are points
    # above max_points and exit code 7 with no points (on the expected answer too).
    r = run_io_tests(judge_sb, [{"input": w, "output": w} for w in ("fail", "much", "none")],
                     code=code, checker=TESTLIB_LIKE)
    assert r.verdicts == ["IE", "IE", "IE"], r.errors
    assert "testlib FAIL" in r.errors[0] and "said fail" in r.errors[0]
    # A Python checker gives partial credit with a number in [0, 1].
    py = {"kind": "python", "source": "def check(i, o, e):\n    return 0.25\n"}
    r = run_io_tests(judge_sb, [{"input": "x", "output": "x"}], code=code, checker=py)
    assert r.verdicts == ["PC"] and r.case_scores == (0.25,)


def test_shapes_languages_and_fences():
    assert normalize_io_tests('{"inputs": ["1"], "outputs": ["2"]}')[0].output == "2"
    assert normalize_io_tests({"input": ["a", "b"], "output": ["c", "d"]})[1].input == "b"
    assert len(normalize_io_tests([{"input": "1", "output": "1", "testtype": "stdin"}])) == 1
    with pytest.raises(InvalidArgument, match="2 inputs but 1 outputs"):
        normalize_io_tests({"inputs": ["1", "2"], "outputs": ["1"]})
    with pytest.raises(InvalidArgument, match="'input' and 'output'"):
        normalize_io_tests([{"in": "1"}])
    assert language_name("C++") == "cpp" and language_name("golang") == "go"
    with pytest.raises(InvalidArgument, match="unknown language"):
        language_name("cobol")
    text = "draft\n```python\nprint(1)\n```\nbetter:\n```cpp\nint main(){}\n```\n"
    assert extract_program(text) == ("int main(){}\n", "cpp")
    assert extract_program(text, language="python") == ("print(1)\n", "python")
    assert extract_program("```\nx\n```", language="rust") == ("x\n", "rust")
    assert extract_program("no code") is None


def test_codegen_env_submits_a_c_file_to_stdin_stdout_tests(daemon):
    from corral.rl.envs.codegen import CodegenEnv, edit, submit

    problem = {"prompt": "Print a+b.", "tests": SUM_TESTS, "language": "c"}
    with CodegenEnv([problem], image="judge", memory_mb=1536, solution_path="main.c",
                    url=daemon.url) as env:
        try:
            env.reset(seed=0)
        except corral.errors.ImageNotFound:
            pytest.skip("the judge built-in image is not built (make install)")
        env.step(edit(PROGRAMS["c"]["AC"]))
        _, reward, terminated, _, info = env.step(submit())
        assert terminated and reward == 1.0, info["report"].feedback()
        env.reset(seed=0)
        env.step(edit(PROGRAMS["c"]["CE"]))
        _, reward, _, _, info = env.step(submit())
        assert reward == 0.0 and info["report"].verdicts == ["CE", "CE"]
