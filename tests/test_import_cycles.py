"""No two bagua modules import each other (tools/import_cycles.py), and the checker finds a circle when one exists."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from import_cycles import cycles  # noqa: E402


def test_no_two_bagua_modules_import_each_other():
    assert cycles(ROOT / "bagua") == []


def test_the_checker_sees_deferred_and_relative_imports_but_not_type_checking_ones(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")  # deferred: still a circle
    (pkg / "b.py").write_text("from . import a\n\ndef g():\n    pass\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import x\n")
    (pkg / "d.py").write_text("import pkg.c\nx = 1\n")
    assert cycles(pkg) == [("pkg.a", "pkg.b")]
