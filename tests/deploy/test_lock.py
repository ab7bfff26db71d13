"""requirements.lock, what the image installs with --require-hashes, covers pyproject.toml's runtime dependencies.

Regenerate it with `make lock` after changing `[project] dependencies`; this test says which requirement is not
covered (missing, a version outside the range, an extra's dependency absent, or a pin without a hash).
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .support import REPO

pytestmark = pytest.mark.deploy

LOCK = REPO / "requirements.lock"
# The archive image's (Dockerfile LOCK=requirements-archive.lock): the same pins plus the `archive` extra.
ARCHIVE_LOCK = REPO / "requirements-archive.lock"
# The image's platform: markers are evaluated as the Linux runtime would.
LINUX = {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "python_version": "3.11",
         "implementation_name": "cpython", "platform_python_implementation": "CPython"}
HINT = "run `make lock` and commit requirements.lock and requirements-archive.lock"


def lock_entries(lock: Path = LOCK) -> dict[str, tuple[str, list[str], str]]:
    """name -> (version, hashes, marker text) for every `name==version` entry of the lock."""
    text = lock.read_text()
    entries: dict[str, tuple[str, list[str], str]] = {}
    for block in re.split(r"\n(?=\S)", text):
        if block.startswith("#") or not block.strip():
            continue
        head = block.split("\\", 1)[0].strip()
        requirement = Requirement(head)
        specs = list(requirement.specifier)
        assert [spec.operator for spec in specs] == ["=="], f"lock entry {head!r} is not an exact pin; {HINT}"
        entries[canonicalize_name(requirement.name)] = (
            specs[0].version, re.findall(r"--hash=sha256:([0-9a-f]{64})", block), str(requirement.marker or ""))
    return entries


def applies(requirement: Requirement, extra: str = "") -> bool:
    return requirement.marker is None or requirement.marker.evaluate({**LINUX, "extra": extra})


def runtime_requirements() -> list[Requirement]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [Requirement(text) for text in pyproject["project"]["dependencies"]]


def test_every_runtime_dependency_is_pinned_within_its_range() -> None:
    entries = lock_entries()
    for requirement in filter(applies, runtime_requirements()):
        name = canonicalize_name(requirement.name)
        assert name in entries, f"{requirement} is not in requirements.lock; {HINT}"
        version = entries[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"requirements.lock pins {name}=={version}, outside pyproject's {requirement}; {HINT}")


def test_the_dependencies_of_requested_extras_are_pinned() -> None:
    """`aiokafka[snappy,lz4,zstd]` must bring cramjam into the image, not only into the dev venv."""
    entries = lock_entries()
    for requirement in filter(applies, runtime_requirements()):
        for extra in requirement.extras:
            for text in metadata.requires(requirement.name) or []:
                dependency = Requirement(text)
                if not applies(dependency, extra) or applies(dependency):
                    continue  # not wanted on Linux, or not specific to the extra (the closure test covers those)
                assert canonicalize_name(dependency.name) in entries, (
                    f"{dependency.name} (from {requirement.name}[{extra}]) is not in requirements.lock; {HINT}")


def test_the_lock_is_closed_under_dependencies() -> None:
    """Every dependency of every locked distribution is locked too (pip --require-hashes refuses otherwise)."""
    entries = lock_entries()
    for name in entries:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed in this venv (e.g. a Windows-only pin): nothing to read its metadata from
        for text in requires:
            dependency = Requirement(text)
            if applies(dependency):
                assert canonicalize_name(dependency.name) in entries, (
                    f"{name} needs {dependency}, which requirements.lock lacks; {HINT}")


def test_every_pin_carries_hashes() -> None:
    for name, (version, hashes, _) in lock_entries().items():
        assert hashes, f"requirements.lock pins {name}=={version} without --hash; {HINT}"


def test_the_archive_lock_is_the_image_lock_plus_the_archive_extra() -> None:
    """The archive image runs the same code on the same pins as the worker's, plus pyarrow within the extra's range,
    closed under its dependencies and hash-pinned."""
    base, archive = lock_entries(), lock_entries(ARCHIVE_LOCK)
    changed = {name for name in base if archive.get(name, ("",))[0] != base[name][0]}
    assert not changed, f"requirements-archive.lock pins {sorted(changed)} differently from requirements.lock; {HINT}"
    extra = [Requirement(text) for text in
             tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["archive"]]
    for requirement in extra:
        name = canonicalize_name(requirement.name)
        assert name in archive, f"{requirement} is not in requirements-archive.lock; {HINT}"
        assert requirement.specifier.contains(archive[name][0]), (
            f"requirements-archive.lock pins {name}=={archive[name][0]}, outside {requirement}; {HINT}")
    added = set(archive) - set(base)
    for name in added:
        assert archive[name][1], f"requirements-archive.lock pins {name} without --hash; {HINT}"
        for text in metadata.requires(name) or []:
            dependency = Requirement(text)
            if applies(dependency):
                assert canonicalize_name(dependency.name) in archive, (
                    f"{name} needs {dependency}, which requirements-archive.lock lacks; {HINT}")
    assert added == {canonicalize_name(r.name) for r in extra}, (
        f"requirements-archive.lock adds {sorted(added)} beyond the archive extra; {HINT}")
