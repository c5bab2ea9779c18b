"""The refusal table is the one place a refusal is said (read from the package's source).

- every ``raise`` of an ``UnsupportedSetup``-family error in ``prefix_sharing/`` goes through
  :func:`prefix_sharing.refusals.refuse` / :func:`~prefix_sharing.refusals.refuse_all`, whose
  keys are literal and registered;
- every registered key is raised somewhere (no stale entry);
- ``refuse`` composes its message from the entry (setting, detail, reason, key) and keeps the
  error class the site asks for;
- every cell of the support matrix names test files that exist or registered refusals that
  apply to its engine, and ``docs/support.md`` and the README's table are what the generator
  writes (``python scripts/docs/support_matrix.py``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import prefix_sharing
from prefix_sharing.errors import InputError, PrefixSharingSetupError, UnsupportedSetup
from prefix_sharing.refusals import ENGINES, REFUSALS, Refused, refuse, refuse_all
from prefix_sharing.support import (COLUMNS, CROSS_COLUMNS, CROSS_MATRIX, MATRIX, STATUSES,
                                    cross_page_with_table, readme_with_table, render_cross_table,
                                    render_page, render_readme_table)

PACKAGE = pathlib.Path(prefix_sharing.__file__).parent
# the UnsupportedSetup family by class name (the integrations' subclasses are not imported here)
FAMILY = {"UnsupportedSetup", "UnsupportedSetupError", "PrefixSharingSetupError",
          "UnsupportedSpecError"}
KEYED = {"refuse", "Refused"}  # the calls that name a key (first argument)


def _called(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def scan(source: str, where: str) -> tuple[list[str], list[str]]:
    """``(keys, problems)`` of one module's source: the keys its ``refuse`` / ``Refused`` calls
    name, and each raise that bypasses the table or call whose key is not a literal."""
    keys, problems = [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            if _called(node.exc) in FAMILY:
                problems.append(f"{where}:{node.lineno}: raise {_called(node.exc)}(...) "
                                "bypasses the refusal table")
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name):
            if node.exc.id in FAMILY:
                problems.append(f"{where}:{node.lineno}: raise {node.exc.id} bypasses the table")
        if isinstance(node, ast.Call) and _called(node) in KEYED:
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                keys.append(first.value)
            else:
                problems.append(f"{where}:{node.lineno}: {_called(node)}() without a literal key")
    return keys, problems


def _package_scan() -> tuple[list[str], list[str]]:
    keys, problems = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("refusals.py", "refusal_table.py", "errors.py"):
            continue
        found, wrong = scan(path.read_text(), str(path.relative_to(PACKAGE.parent)))
        keys += found
        problems += wrong
    return keys, problems


def test_every_refusal_raise_goes_through_the_table():
    keys, problems = _package_scan()
    assert problems == []
    assert sorted(set(keys) - set(REFUSALS)) == [], "keys raised but not registered"


def test_every_registered_refusal_is_raised_somewhere():
    keys, _ = _package_scan()
    assert sorted(set(REFUSALS) - set(keys)) == [], "registered keys no site raises"


def test_the_walker_catches_a_bypass_and_an_unliteral_key():
    """The control: a raise the old way, a computed key, and a proper one."""
    source = (
        "def f(x, key):\n"
        "    if x:\n"
        "        raise UnsupportedSetupError('prefix sharing does not support x')\n"
        "    if key:\n"
        "        raise refuse(key, 'detail')\n"
        "    raise refuse('megatron.mtp', f'mtp_num_layers={x}', error=UnsupportedSetupError)\n"
        "found = [Refused('verl.mtp'), errors.PrefixSharingSetupError]\n"
        "raise errors.PrefixSharingSetupError('old way')\n"
    )
    keys, problems = scan(source, "m.py")
    assert sorted(keys) == ["megatron.mtp", "verl.mtp"]
    assert len(problems) == 3
    assert any("m.py:3: raise UnsupportedSetupError" in p for p in problems)
    assert any("m.py:5: refuse() without a literal key" in p for p in problems)
    assert any("m.py:8: raise PrefixSharingSetupError" in p for p in problems)


def test_each_entry_names_its_setting_reason_and_engines():
    for key, entry in REFUSALS.items():
        assert entry.key == key and "." in key
        assert entry.setting.strip() and entry.reason.strip(), key
        assert entry.engines and set(entry.engines) <= set(ENGINES), key


def test_refuse_composes_the_message_from_the_entry():
    entry = REFUSALS["megatron.mtp"]
    error = refuse("megatron.mtp", "mtp_num_layers=2")
    assert type(error) is UnsupportedSetup
    assert str(error) == (f"prefix sharing refuses {entry.setting} (mtp_num_layers=2): "
                          f"{entry.reason} [megatron.mtp]")
    assert error.refusals == ("megatron.mtp",)
    assert str(refuse("megatron.attention_bias")) == (
        f"prefix sharing refuses {REFUSALS['megatron.attention_bias'].setting}: "
        f"{REFUSALS['megatron.attention_bias'].reason} [megatron.attention_bias]")


def test_refuse_keeps_the_sites_error_class():
    class SiteError(UnsupportedSetup, RuntimeError):
        pass

    error = refuse("megatron.attention_bias", error=SiteError)
    assert type(error) is SiteError and isinstance(error, RuntimeError)
    assert isinstance(refuse("verl.mtp", error=PrefixSharingSetupError), InputError)


def test_refuse_all_names_every_problem_once_and_the_common_advice():
    found = [Refused("verl.ulysses.recurrent", "ulysses_sequence_parallel_size=2"),
             Refused("verl.fused_kernels", "use_fused_kernels=True")]
    error = refuse_all(found, error=PrefixSharingSetupError, advice="Or turn sharing off.")
    message = str(error)
    assert message.startswith("prefix sharing refuses " + str(found[0]) + "; " + str(found[1]))
    assert message.endswith(". Or turn sharing off.")
    assert error.refusals == ("verl.ulysses.recurrent", "verl.fused_kernels")
    with pytest.raises(ValueError, match="at least one"):
        refuse_all([])


def test_an_unregistered_key_is_a_bug_not_a_refusal():
    with pytest.raises(KeyError, match="not a registered refusal"):
        refuse("megatron.no_such_setting")


# ------------------------------------------------------------------ the support matrix
@pytest.mark.parametrize("matrix, columns", [(MATRIX, COLUMNS), (CROSS_MATRIX, CROSS_COLUMNS)],
                         ids=["support", "cross_micro_batch"])
def test_every_cell_of_the_matrix_is_shown_by_a_test_or_a_refusal(matrix, columns):
    root = PACKAGE.parent
    for feature, row in matrix.items():
        assert list(row) == list(columns), feature
        for column, cell in row.items():
            where = f"{feature} / {column}"
            assert cell.status in STATUSES, where
            assert [t for t in cell.tests if not (root / t).is_file()] == [], where
            assert bool(cell.tests) == (cell.status == "works"), where
            assert (cell.status != "refused") or cell.refusals, where
            for key in cell.refusals:
                assert key in REFUSALS, (where, key)
                assert column in REFUSALS[key].engines, (where, key, REFUSALS[key].engines)


def test_the_support_page_and_the_readme_table_are_generated_from_the_tables():
    """Regenerate with ``python scripts/docs/support_matrix.py``."""
    root = PACKAGE.parent
    assert (root / "docs" / "support.md").read_text() == render_page()
    readme = (root / "README.md").read_text()
    assert readme_with_table(readme) == readme
    assert render_readme_table() in readme
    cross = (root / "docs" / "cross-micro-batch.md").read_text()
    assert cross_page_with_table(cross) == cross and render_cross_table() in cross


def test_a_stale_page_is_caught(tmp_path):
    """The control: a README whose table lost a row is not what the generator writes."""
    readme = (PACKAGE.parent / "README.md").read_text()
    row = next(line for line in render_readme_table().splitlines() if "MLA" in line)
    stale = readme.replace(row + "\n", "")
    assert stale != readme and readme_with_table(stale) == readme
    with pytest.raises(ValueError, match="no .* block"):
        readme_with_table("no markers here")


def test_the_page_lists_every_refusal_with_its_setting_and_engines():
    page = render_page()
    for key, entry in REFUSALS.items():
        assert f"| `{key}` | {entry.setting} |" in page
        assert page.count(f"`{key}`") >= 1
