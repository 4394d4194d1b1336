"""List the commits whose subject is longer than 72 characters, among those made after the convention began.

CONTRIBUTING.md asks for a subject of at most 72 characters (the reasons and figures go in the body). History
before :data:`BASE`, the first commit of the convention, is left as it is. Merge commits are checked too. Where
``BASE`` is not an ancestor of ``HEAD`` (another history) or the clone is shallow (CI's ``--depth 1``), only
``HEAD``'s subject is checked.

Usage::

    python tools/check_commit_subjects.py [--repo DIR] [--base REV] [--max N]   # exit 1 and list them, if any

Example:
    >>> long_subjects(".", base="HEAD")  # nothing comes after HEAD
    []
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Optional, Sequence

__all__ = ["BASE", "MAX_SUBJECT", "GRANDFATHERED", "commits_to_check", "long_subjects", "main"]

#: The first commit of the convention (993d971, "Move benchmarks out of the package, group torch_api by layer").
BASE = "993d971989f821f53a89584417e199de6e54f704"
MAX_SUBJECT = 72
#: Commits after BASE that landed with a longer subject, let through by hash (landed history is never rewritten).
#: Empty: a commit with a long subject is reworded before it lands.
GRANDFATHERED: frozenset[str] = frozenset()


def _git(repo: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, encoding="utf-8")


def commits_to_check(repo: str, base: str = BASE) -> str:
    """Return the revision range to check: ``base..HEAD``, or only ``HEAD`` where that range cannot be read."""
    shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    # --is-ancestor exits 1 for "not an ancestor" and 128 for an unknown commit: both mean another history
    if shallow or _git(repo, "merge-base", "--is-ancestor", base, "HEAD").returncode != 0:
        return "-1 HEAD"
    return f"{base}..HEAD"


def long_subjects(repo: str, base: str = BASE, limit: int = MAX_SUBJECT) -> list[tuple[str, str]]:
    """Return ``(short hash, subject)`` of each commit to check whose subject is over ``limit`` characters."""
    out = _git(repo, "log", "--format=%H%x00%s", *commits_to_check(repo, base).split())
    if out.returncode != 0:
        raise RuntimeError(f"git log failed in {repo}: {out.stderr.strip()}")
    rows = [line.split("\0", 1) for line in out.stdout.splitlines() if line]
    return [(h[:7], s) for h, s in rows if len(s) > limit and h not in GRANDFATHERED]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print each over-long subject with its hash and length; return 1 if there is any, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=".", help="the git checkout (default: the current folder)")
    parser.add_argument("--base", default=BASE, help="check the commits after this one (default: %(default)s)")
    parser.add_argument("--max", type=int, default=MAX_SUBJECT, help="longest subject allowed (%(default)s)")
    args = parser.parse_args(argv)
    bad = long_subjects(args.repo, args.base, args.max)
    for h, subject in bad:
        print(f"{h} {len(subject)} characters: {subject}")
    if bad:
        print(f"{len(bad)} commit subject(s) over {args.max} characters; put the details in the body "
              "(CONTRIBUTING.md)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
