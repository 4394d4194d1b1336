"""No import circles among bagua modules, no package imports another's private module (tools/import_cycles.py),
and the checker finds both when they exist."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from import_cycles import cycles, private_imports, private_names  # noqa: E402


def _package(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_bagua_has_no_import_circle():
    assert cycles(ROOT / "bagua") == []


def test_no_bagua_package_imports_another_packages_private_module_or_name():
    assert private_imports(ROOT / "bagua") == []
    assert private_names(ROOT / "bagua") == []


def test_a_circle_behind_type_checking_is_found(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import x\n",
        "pkg/d.py": "import pkg.c\nx = 1\n",
    })
    assert cycles(pkg) == [["pkg.c", "pkg.d"]]


def test_a_long_circle_is_found_whole_with_deferred_and_relative_imports(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "from pkg import a, b, c, free\n",  # re-exporting its own submodules: no circle
        "pkg/a.py": "def f():\n    from pkg.b import g\n",  # deferred: still an edge
        "pkg/b.py": "from .c import h\n\ndef g():\n    pass\n",
        "pkg/c.py": "from pkg import a\n\ndef h():\n    pass\n",  # `from pkg import module`: an edge to pkg.a
        "pkg/free.py": "from pkg.a import f\n",  # imports into the circle, is not part of it
    })
    assert cycles(pkg) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_a_package_re_exporting_its_submodules_is_no_circle(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "from pkg.sub import thing\n",
        "pkg/sub/__init__.py": "from pkg.sub.leaf import thing\n",
        "pkg/sub/leaf.py": "import pkg.other\nthing = 1\n",
        "pkg/other.py": "x = 2\n",
    })
    assert cycles(pkg) == []


def test_a_private_module_imported_from_another_package_is_found(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/inner/__init__.py": "from pkg.inner import _impl\n",  # its own package: fine
        "pkg/inner/_impl.py": "x = 1\n",
        "pkg/inner/deeper/__init__.py": "from pkg.inner._impl import x\n",  # a subpackage of the owner: fine
        "pkg/outer.py": "from pkg.inner import _impl\n",
        "pkg/other/__init__.py": "",
        "pkg/other/user.py": "from pkg.inner._impl import x\n",
    })
    assert private_imports(pkg) == [("pkg.other.user", "pkg.inner._impl"), ("pkg.outer", "pkg.inner._impl")]


def test_a_private_name_imported_from_another_package_is_found(tmp_path):
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/inner/__init__.py": "from pkg.inner.mod import _helper\n",  # its own package: fine
        "pkg/inner/mod.py": "def _helper():\n    pass\n\ndef public():\n    pass\n",
        "pkg/other.py": "from pkg.inner.mod import _helper, public\n",
        "pkg/fine.py": "from pkg.inner.mod import public\nfrom pkg.inner import mod\nx = mod._helper\n",
    })
    assert private_names(pkg) == [("pkg.other", "pkg.inner.mod._helper")]


def test_the_script_exits_0_on_bagua_and_1_naming_a_circle(tmp_path):
    import subprocess

    script = str(ROOT / "tools" / "import_cycles.py")
    clean = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert (clean.returncode, clean.stdout) == (0, ""), clean.stdout + clean.stderr
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import x\n",
        "pkg/d.py": "import pkg.c\nx = 1\n",
        "pkg/e/__init__.py": "",
        "pkg/e/user.py": "from pkg.f import _impl\n",
        "pkg/f/__init__.py": "",
        "pkg/f/_impl.py": "",
    })
    found = subprocess.run([sys.executable, script, str(pkg)], capture_output=True, text=True, timeout=120)
    assert found.returncode == 1
    assert found.stdout.splitlines() == ["circle: pkg.c <-> pkg.d", "private: pkg.e.user imports pkg.f._impl"]
