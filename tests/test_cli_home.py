"""Where the commands keep files by default: a node's and `models`' --data-dir follow
$EDGELITE_HOME as the client's files do (issue 66: they ignored it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgelite.cli.main import build_parser


@pytest.mark.unit
@pytest.mark.parametrize("argv", [["node"], ["models"]])
def test_data_dir_follows_edgelite_home(argv: list[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGELITE_HOME", str(tmp_path / "home"))
    assert build_parser().parse_args(argv).data_dir == tmp_path / "home"
    monkeypatch.delenv("EDGELITE_HOME")
    assert build_parser().parse_args(argv).data_dir == Path.home() / ".edgelite"
