"""The lock files (locks/*.txt, made by scripts/lock) agree with pyproject.toml, and the suite
runs in the environment the test lock describes.

pyproject.toml keeps ranges (what commpress works with); a lock pins what scripts/demo and
scripts/test install, so a dependency's new release cannot turn a fresh clone red. These tests
fail when a range in pyproject no longer admits the locked version, when a locked file misses
a package pyproject asks for, or when the running environment drifted from the test lock.
"""

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ["demo", "test"]


def read_lock(name: str) -> tuple[dict[str, Version], list[str]]:
    """Pinned versions by canonical name, and the lock's extras (its header's ``# extras:``)."""
    pins: dict[str, Version] = {}
    extras: list[str] = []
    for line in (ROOT / "locks" / f"{name}.txt").read_text().splitlines():
        if line.startswith("# extras:"):
            extras = [e for e in line.removeprefix("# extras:").split() if e != "none"]
        elif line and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"locks/{name}.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins, extras


def project_requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


@pytest.mark.parametrize("name", LOCKS)
def test_every_requirement_of_pyproject_is_locked_at_a_version_it_admits(name):
    pins, extras = read_lock(name)
    wrong = []
    for req in project_requirements(extras):
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None or not req.specifier.contains(pinned, prereleases=True):
            wrong.append(f"{req} (locked: {pinned or 'missing'})")
    assert not wrong, f"locks/{name}.txt disagrees with pyproject.toml: {wrong}; refresh it with scripts/lock"


@pytest.mark.parametrize("name", LOCKS)
def test_torch_is_locked_to_the_cpu_build_on_disk(name):
    pins, _ = read_lock(name)
    assert pins["torch"].public == "2.13.0" and pins["torch"].local == "cpu"


def test_the_demo_lock_is_the_test_lock_without_the_test_extra():
    demo, _ = read_lock("demo")
    test, _ = read_lock("test")
    differ = {n: (v, test.get(n)) for n, v in demo.items() if test.get(n) != v}
    assert not differ, f"the demo and test locks pin these differently: {differ}; refresh both with scripts/lock"


def test_this_environment_is_the_test_lock():
    """scripts/test installs locks/test.txt exactly; a run elsewhere says how to get there."""
    pins, _ = read_lock("test")
    drift = {}
    for name, version in pins.items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            drift[name] = (str(version), str(installed))
    assert not drift, f"installed versions differ from locks/test.txt (locked, installed): {drift}; run scripts/test"
