"""Tensorlake's process output, kept in the daemon: bounded whatever the sandbox writes."""

from corral.server.compat.tensorlake_process import MAX_LINE_CHARS, LineSplitter


def test_output_without_newlines_is_held_at_most_one_line_long():
    # A sandbox writing forever without a newline must not grow the daemon (review:
    # the pending rest of a line grew without bound once processes ran on Engine.spawn).
    split, chunk, pieces = LineSplitter(), "x" * 65536, []
    for _ in range(3 * MAX_LINE_CHARS // 65536 + 1):
        pieces += split.feed(chunk)
        assert len(split._rest) <= MAX_LINE_CHARS
    assert pieces and all(len(p) == MAX_LINE_CHARS for p in pieces)
    assert split.feed("end\n")[-1].endswith("end")


def test_lines_are_split_as_they_come():
    split = LineSplitter()
    assert split.feed("a\nb") == ["a"]
    assert split.feed("c\n\nd") == ["bc", ""]
    assert split.flush() == "d" and split.flush() is None
