"""Every ``--help`` is plain text: the docstrings the descriptions come from are written for the
API reference, and argparse prints reStructuredText markup as it stands."""

from __future__ import annotations

import re

import pytest

from prefix_sharing.cli import COMMANDS, main
from prefix_sharing.cli.options import help_text
from prefix_sharing.workloads import LONG_WORKLOADS

MARKUP = re.compile(r"``|:(mod|func|class|data|meth|attr):`")


@pytest.mark.parametrize("command", [c.__name__.rsplit(".", 1)[-1] for c in COMMANDS])
def test_help_has_no_markup(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert out and not MARKUP.search(out), out


def test_help_text_keeps_a_roles_target_and_a_literals_content():
    doc = "Title.\n\nSee :mod:`a.b`, :func:`~x.y.z` and ``--flag``\nhere.\n\nMore."
    assert help_text(doc) == "See a.b, z and --flag here."


def test_verify_lists_every_workload_it_accepts(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(name in out for name in LONG_WORKLOADS)
