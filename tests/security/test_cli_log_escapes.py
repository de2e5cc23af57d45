"""`corral logs` prints what a sandbox chose (its argv, its output's tails, reasons) to
an operator's terminal: escape sequences in it must arrive as text, not act."""

from corral.cli._ops import format_entry


def test_escape_sequences_from_a_sandbox_reach_the_terminal_inert():
    entry = {
        "kind": "command", "argv": ["echo", "\x1b[2J\x1b[H"], "outcome": "exit",
        "exit_code": 0, "started_at": 0.0, "ended_at": 1.0,
        "stdout_tail": "ok\x1b]0;owned title\x07\n\x9b31mred\nx\ty\n", "stderr_tail": "\r\x08",
    }
    text = format_entry(entry)
    assert not any(ch in text for ch in "\x1b\x07\x9b\r\x08")
    assert "\\x1b[2J" in text and "\\x1b]0;owned title\\x07" in text and "\\x9b31mred" in text
    assert "x\ty" in text and "\n" in text  # tabs and newlines are kept
    event = format_entry({"kind": "event", "at": 0.0, "event": "stopped", "reason": "\x1bc"})
    assert "\x1b" not in event and "\\x1bc" in event
