"""``python -m bagua.advise.render``: write the README's which-algorithm table from the picks file.

``--markdown`` prints the table; ``--update README.md`` rewrites it between the README's markers
(:data:`bagua.advise.table.TABLE_BEGIN` and :data:`~bagua.advise.table.TABLE_END`). tests/test_advise.py fails
when the README's table differs from this rendering of ``bagua/advise/picks.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from bagua.advise.table import render_markdown, update_readme

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the README's table (``--markdown``) or write it into a README between its markers (``--update``)."""
    p = argparse.ArgumentParser(prog="python -m bagua.advise.render", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", action="store_true", help="print the README's which-algorithm table")
    what.add_argument("--update", metavar="README", help="rewrite the table between its markers in this file")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(render_markdown())
        return 0
    with open(args.update, encoding="utf-8") as f:
        text = f.read()
    with open(args.update, "w", encoding="utf-8") as f:
        f.write(update_readme(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
