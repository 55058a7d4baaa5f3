"""What ``pip install statetier`` gives is all of statetier (issue 41 item 1).

- Every package folder of the tree (a folder with an ``__init__.py`` under a root that
  pyproject.toml's ``package-dir`` maps) is in the built wheel. Regression: the hand-written
  package list lacked ``statetier.tiers.peer``; editable installs hid it.
- The wheel installed into a clean venv (no editable path, no checkout on ``sys.path``)
  starts two daemons with every tier (host, disk, Redis, peers) that round-trip a published
  object from one to the other through the peer tier. The venv gets its third-party
  dependencies from the test's own environment through a ``.pth`` line (the locked set, no
  network); statetier itself can come only from the wheel: that environment holds statetier
  as an editable finder, which a path added by a ``.pth`` line does not run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from statetier.launch import RedisServer
from tests.support.deploy_files import REPO, package_folders

ROUND_TRIP = textwrap.dedent("""
    import sys, sysconfig
    from pathlib import Path

    import torch

    import statetier
    from statetier.clients import Client
    from statetier.launch import DaemonProcess
    from statetier.protocol import NamespaceSpec, prefix_hash
    from statetier.protocol.keyring import Keyring

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    print("statetier from", statetier.__file__)
    assert Path(statetier.__file__).resolve().is_relative_to(site), statetier.__file__
    assert not any(Path(p or ".").resolve() == Path(sys.argv[2]).resolve() for p in sys.path), sys.path
    keyring = Path("keyring.json").resolve()
    Keyring.generate().save(keyring)
    ns = NamespaceSpec("wheel/test", revision="main", kv_dtype="bfloat16", ssm_dtype="float32")
    tokens = list(range(64))
    snapshot = {"conv": torch.randn(3, 64), "ssm": torch.randn(64, 16)}
    settings = {"peers.enabled": "true"}
    with DaemonProcess(name="prefill", redis_url=sys.argv[1], keyring=keyring, settings=settings) as prefill, \\
            DaemonProcess(name="decode", redis_url=sys.argv[1], keyring=keyring, settings=settings) as decode:
        for daemon in (prefill, decode):
            banner = daemon.log_text()
            assert all(f"tier {t}:" in banner for t in ("host", "disk", "peer", "redis")), banner
        with Client(prefill.url, namespace=ns) as client:
            ref = client.put_ssm(3, prefix_hash(tokens), len(tokens), snapshot, request_id="r", publish=True)
        with Client(decode.url, namespace=ns) as client:
            state = client.load(ref)
        assert all(torch.equal(state[name], snapshot[name]) for name in snapshot)
        assert decode.counters().get("hits peer") == 1, decode.counters()
    print("round trip through the peer tier: ok")
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the sources (a ``build/lib`` left in the checkout by an earlier
    build would be packed too, and hide a package the list forgot)."""
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, source / name)
    for folder in set(mapping.values()):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(out), str(source)], capture_output=True, text=True, timeout=600,
                           cwd=source)
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("statetier-*.whl")
    return path


@pytest.fixture(scope="module")
def clean_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv without pip or system site-packages, the wheel installed into it by this
    environment's pip (``--python``), this environment's site-packages appended by a ``.pth``."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True, timeout=300,
                               env=outside_the_checkout(), cwd=venv)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert "Successfully installed statetier-" in installed.stdout, installed.stdout
    print(installed.stdout[-600:])
    site = purelib(python, venv)
    (Path(site) / "deps-of-the-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    yield python


def outside_the_checkout() -> dict[str, str]:
    """This environment without what would put the checkout on a child's ``sys.path``."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("STATETIER_")}


def purelib(python: Path, cwd: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, cwd=cwd, env=outside_the_checkout()).stdout.strip()


def test_every_package_folder_of_the_tree_is_in_the_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = package_folders()
    assert "statetier.tiers.peer" in folders
    assert [p for p in folders if f"{p.replace('.', '/')}/__init__.py" not in names] == []
    assert "statetier/daemon/__main__.py" in names


def test_the_installed_wheel_serves_every_tier_and_round_trips_through_a_peer(clean_venv: Path,
                                                                              tmp_path: Path) -> None:
    env = outside_the_checkout()
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    with RedisServer() as redis:
        ran = subprocess.run([str(clean_venv), str(script), redis.url, str(REPO)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=240)
    print(ran.stdout, ran.stderr[-4000:])
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-4000:]
    site = purelib(clean_venv, tmp_path)
    assert f"statetier from {site}/statetier/__init__.py" in ran.stdout
    assert "round trip through the peer tier: ok" in ran.stdout
