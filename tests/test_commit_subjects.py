"""tools/check_commit_subjects.py in throw-away git repositories: what it checks after the base, merges, and the
HEAD-only fallback for another history or a shallow clone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "check_commit_subjects.py")
LONG = "Make " + "x" * 68  # 73 characters
EDGE = "Make " + "y" * 67  # 72 characters: allowed

if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:  # pragma: no cover
    pytest.skip("needs git", allow_module_level=True)


def _git(repo, *args) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.org", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "-C", str(repo), *args], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(repo, subject: str) -> str:
    _git(repo, "commit", "--allow-empty", "-q", "-m", subject, "-m", "the body may be as long as it likes " * 5)
    return _git(repo, "rev-parse", "HEAD")


def _check(repo, *args) -> tuple[int, str]:
    out = subprocess.run([sys.executable, TOOL, "--repo", str(repo), *args], capture_output=True, text=True,
                         timeout=60)
    return out.returncode, out.stdout


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    _git(path, "init", "-q", "-b", "main")
    _commit(path, LONG + " before the base")  # history before the base is left as it is
    return path


def test_only_commits_after_the_base_are_checked(repo):
    base = _commit(repo, "Start the convention")
    _commit(repo, EDGE)
    assert _check(repo, "--base", base) == (0, "")
    bad = _commit(repo, LONG)
    _commit(repo, "Fix it later")
    code, out = _check(repo, "--base", base)
    assert code == 1 and out.split()[:3] == [bad[:7], "73", "characters:"] and len(out.splitlines()) == 1


def test_merge_commits_are_checked(repo):
    base = _commit(repo, "Start the convention")
    _git(repo, "checkout", "-q", "-b", "side")
    _commit(repo, "Work on a side branch")
    _git(repo, "checkout", "-q", "main")
    _commit(repo, "Work on main")
    _git(repo, "merge", "-q", "--no-ff", "side", "-m", "Merge " + "z" * 70)
    code, out = _check(repo, "--base", base)
    assert code == 1 and "Merge zzz" in out


def test_another_history_checks_only_head(repo):
    # the default base (this project's 993d971) is not in this repository
    _commit(repo, "A short subject at HEAD")
    assert _check(repo) == (0, "")
    _commit(repo, LONG)
    assert _check(repo)[0] == 1


def test_a_shallow_clone_checks_only_head(repo, tmp_path):
    base = _commit(repo, "Start the convention")
    _commit(repo, LONG)
    _commit(repo, "A short subject at HEAD")
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(clone))
    assert _check(clone, "--base", base) == (0, "")
    assert _check(repo, "--base", base)[0] == 1  # the full history has the long one


def test_grandfathered_commits_are_let_through(repo, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_commit_subjects", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    base = _commit(repo, "Start the convention")
    old = _commit(repo, LONG)
    assert [h for h, _ in tool.long_subjects(str(repo), base)] == [old[:7]]
    monkeypatch.setattr(tool, "GRANDFATHERED", frozenset({old}))
    assert tool.long_subjects(str(repo), base) == []
