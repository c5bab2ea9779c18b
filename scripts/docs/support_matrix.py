"""Writes docs/support.md, the README's support table and the cross-micro-batch table
(docs/cross-micro-batch.md) from prefix_sharing.support and the refusal table; ``--check``
only says which of them is stale (exit 1), as CI's docs step does.

    python scripts/docs/support_matrix.py          # rewrite what is stale
    python scripts/docs/support_matrix.py --check  # fail on a stale file
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prefix_sharing.support import (cross_page_with_table, readme_with_table,  # noqa: E402
                                    render_page)


def generated() -> dict[pathlib.Path, str]:
    """Each generated file and the text it should hold."""
    readme, cross = ROOT / "README.md", ROOT / "docs" / "cross-micro-batch.md"
    return {ROOT / "docs" / "support.md": render_page(),
            readme: readme_with_table(readme.read_text()),
            cross: cross_page_with_table(cross.read_text())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    stale = {path: text for path, text in generated().items()
             if not path.exists() or path.read_text() != text}
    for path, text in stale.items():
        if args.check:
            print(f"{path.relative_to(ROOT)} is stale: run python scripts/docs/support_matrix.py",
                  file=sys.stderr)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
