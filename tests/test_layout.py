"""The test suite mirrors the package: the tests of ``gbmpo.<package>`` live in
``tests/<package>/``, so that every test folder names a package and every package has one.
The top level holds the tests of the top-level modules (``models``, ``registry``) and of the
repository as a whole; ``tests/fuzz`` fuzzes the commands across packages."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gbmpo"
TESTS = ROOT / "tests"
#: test folders that test several packages at once, with why
CROSS_CUTTING = {"fuzz": "fuzzes the command lines, data files and rewards of several packages"}


def _packages() -> set[str]:
    return {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()}


def _test_folders() -> set[str]:
    return {d.name for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py"))}


def test_every_test_folder_is_a_package_of_gbmpo() -> None:
    orphans = _test_folders() - _packages() - set(CROSS_CUTTING)
    assert not orphans, (
        f"tests/{sorted(orphans)} name no package of src/gbmpo: move their tests to the folder of "
        f"the package they test (packages: {sorted(_packages())})"
    )


def test_every_package_of_gbmpo_has_a_test_folder() -> None:
    missing = _packages() - _test_folders()
    assert not missing, f"no tests/<package>/ with test files for {sorted(missing)}"


def test_module_names_are_unique_and_the_cross_cutting_folders_exist() -> None:
    names: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    repeated = {name: paths for name, paths in names.items() if len(paths) > 1}
    # the suite has no __init__.py files: pytest imports test modules by their base name
    assert not repeated, f"test module names must be unique across tests/: {repeated}"
    assert set(CROSS_CUTTING) <= _test_folders()
