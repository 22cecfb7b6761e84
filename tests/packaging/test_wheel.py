"""The install: one `dspark_serve` namespace in site-packages, console scripts that work."""

import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("server", "scheduler", "drafter", "verifier", "ops", "training", "configs")


def _declared_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_every_package_folder_is_declared_under_the_namespace():
    found = sorted(
        "dspark_serve." + ".".join(p.parent.relative_to(ROOT).parts)
        for top in FOLDERS
        for p in (ROOT / top).rglob("__init__.py")
    )
    assert found and sorted(_declared_packages()) == found


def test_the_image_copies_every_package_folder():
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert copied == set(FOLDERS)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (whl,) = out.glob("dspark_serve-*.whl")
    return whl


@pytest.mark.slow
def test_the_wheel_holds_one_namespace_and_no_generic_names(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"dspark_serve", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert not tops & set(FOLDERS)
    for must in (
        "dspark_serve/server/cli.py",
        "dspark_serve/configs/embedded.toml",
        "dspark_serve/server/static/index.html",
        "dspark_serve/ops/csrc/paged_attention.c",  # the CPU kernels build from these on first use
        "dspark_serve/ops/csrc/common.h",
        "dspark_serve/drafter/checkpoints/smollm2-135m-dspark/config.json",
    ):
        assert must in names, must


@pytest.mark.slow
def test_console_scripts_work_from_an_install_reusing_the_installed_dependencies(wheel, tmp_path):
    """A fresh environment whose only extra path is this one's site-packages (torch, fastapi, ...),
    read as a plain directory, so the editable install of the checkout is not visible in it."""
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    for script in ("dspark-serve", "dspark-train", "dspark-serve-ray"):
        proc = subprocess.run(
            [env_dir / "bin" / script, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0 and "usage:" in proc.stdout, (script, proc.stderr[-2000:])
    probe = (
        "import importlib.util, dspark_serve.server.cli as c; print(c.__file__); "
        "from dspark_serve.server.app import live_page_html; assert '</html>' in live_page_html(); "
        "print([n for n in ('server', 'scheduler', 'drafter', 'verifier', 'configs') "
        "if importlib.util.find_spec(n)])"
    )
    out = subprocess.run([py, "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    where, generic = out.splitlines()
    assert Path(where).is_relative_to(env_dir)  # the wheel's copy, not the checkout
    assert generic == "[]"
