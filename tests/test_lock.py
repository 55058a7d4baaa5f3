"""The lock (requirements/lock.txt) against pyproject.toml's ranges (issue 31).

``make venv`` installs exactly the lock and checks it (scripts/lock_diff.py --check); these
tests hold the lock itself to the contract: every declared requirement is pinned, inside its
range, for every Python the project supports; torch is the CPU build (no CUDA packages); and
the comparison that ``make test-latest`` prints names what differs.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scripts import lock_diff

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements" / "lock.txt"
PYTHONS = ("3.11", "3.12", "3.13", "3.14")


def declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(text) for text in [*project["dependencies"], *extras["test"], *extras["bench"]]]


def pins_for(python: str) -> dict[str, str]:
    """The lock's pins whose markers hold on Linux x86_64 CPython ``python``."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}
    pins = {}
    for line in LOCK.read_text().splitlines():
        match = lock_diff._PIN.match(line.strip())
        if match and (match["marker"] is None or Marker(match["marker"]).evaluate(env)):
            pins[canonicalize_name(match["name"])] = match["version"]
    return pins


@pytest.mark.parametrize("python", PYTHONS)
def test_every_declared_requirement_is_pinned_inside_its_range(python):
    pins = pins_for(python)
    for requirement in declared():
        if requirement.marker is not None and not requirement.marker.evaluate({"sys_platform": "linux"}):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in the lock for Python {python}: run make lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            f"the lock pins {name}=={pins[name]}, outside {requirement}: run make lock"


def test_torch_is_the_cpu_build_and_nothing_of_cuda_is_locked():
    pins = pins_for("3.11")
    assert pins["torch"].endswith("+cpu")
    cuda = [name for name in pins if name.startswith(("nvidia-", "cuda-", "triton"))]
    assert cuda == [], f"the lock would install CUDA packages: {cuda}"


def test_transformers_is_locked_at_a_release_the_adapter_was_read_on():
    from statetier.clients.transformers import CHECKED_ON

    assert pins_for("3.11")["transformers"] in CHECKED_ON


def test_the_comparison_names_each_difference():
    pins = {"transformers": "5.25.0", "redis": "8.2.0", "gone": "1.0"}
    have = {"transformers": "5.26.0", "redis": "8.2.0", "extra": "2.0"}
    assert lock_diff.differences(pins, have) == ["extra (not locked) 2.0", "gone 1.0 -> absent",
                                                  "transformers 5.25.0 -> 5.26.0"]
    assert lock_diff.differences(pins, dict(pins)) == []


def test_check_passes_on_a_lock_of_this_environment_and_names_a_changed_pin(tmp_path, capsys):
    have = lock_diff.installed()
    lock = tmp_path / "lock.txt"
    lock.write_text("# a comment\n" + "".join(f"{name}=={version}\n    # via x\n" for name, version in have.items())
                    + "not-for-here==1.0 ; sys_platform == 'win32'\n")
    assert lock_diff.main(["--check", str(lock)]) == 0
    assert capsys.readouterr().out.strip() == f"environment matches the lock ({len(have)} packages)"
    name = sorted(have)[0]
    lock.write_text(lock.read_text().replace(f"{name}=={have[name]}\n", f"{name}==0.0.0\n"))
    assert lock_diff.main(["--check", str(lock)]) == 1
    assert capsys.readouterr().out.strip() == f"differs from the lock (1): {name} 0.0.0 -> {have[name]}"
    assert lock_diff.main([str(lock)]) == 0  # without --check, information only
    capsys.readouterr()
    lock_diff.main([str(lock), "--name", name, "--name", "no-such-package"])
    assert capsys.readouterr().out.strip().endswith(f"; {name} {have[name]}; no-such-package absent")
