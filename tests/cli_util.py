"""Running ``handformer`` in-process in tests, with the CLI's contract checked."""

from __future__ import annotations

import pytest

from handformer.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    """Run ``handformer ARGV`` in-process; return ``(exit code, stdout, stderr)``.

    The contract every command keeps: exit 0, or exit 2 with one line on stderr
    (``handformer ...: error: ...``) and no traceback anywhere.
    """
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code in (0, 2), (argv[:3], code, err[-800:])
    assert "Traceback" not in err and "Traceback" not in out
    if code == 2:
        assert err.endswith("\n") and err.count("\n") == 1, err
        assert err.startswith("handformer") and " error: " in err, err
    return code, out, err
