"""Checks shared by the CLI tests."""


def assert_one_line_error(result, *needles: str):
    """A CliRunner result failed with exactly one `Error: ...` line containing every needle, and no traceback."""
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    out = result.output
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), out
    for needle in needles:
        assert needle in lines[0], out
