"""The export's progress line: a step without a count (reading the source) shows no "0/None"
(issue 66, item 11); a counted one shows done/total."""

from __future__ import annotations

import pytest
from rich.progress import Progress

from edgelite_export.cli import Count


@pytest.mark.unit
def test_a_step_without_a_count_shows_none() -> None:
    bar = Progress()
    task = bar.add_task("reading the source", total=None)
    assert Count().render(bar.tasks[0]).plain == ""
    bar.update(task, completed=3, total=18)
    assert Count().render(bar.tasks[0]).plain == "3/18"
