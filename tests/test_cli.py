"""The command line's help: each command's summary reads as the sentence its docstring writes."""

import inspect

import pytest
import typer
from typer.testing import CliRunner

from service.cli import app, bench_app


@pytest.mark.parametrize(("group", "args"), [(app, []), (bench_app, ["bench"])])
def test_each_commands_summary_is_one_line_in_the_list_of_commands(group: typer.Typer, args: list[str]) -> None:
    """A docstring's first paragraph is joined into one line (on a terminal wide enough), not broken where the
    source breaks its lines."""
    res = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "1000"})
    assert res.exit_code == 0, res.output
    lines = [" ".join(line.replace("│", " ").split()) for line in res.output.splitlines()]
    commands = [c for c in group.registered_commands if c.callback is not None]
    assert len(commands) >= 3
    for command in commands:
        summary = " ".join(inspect.cleandoc(command.callback.__doc__ or "").split("\n\n")[0].split())
        name = command.name or command.callback.__name__
        assert any(line == f"{name} {summary}" for line in lines), (name, summary, res.output)
