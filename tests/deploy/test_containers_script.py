"""scripts/containers.sh, the release scripts (release.sh, oci-registry.sh), schema-registry.sh and the local test
images' scripts are shellcheck-clean; the script and the Makefile
agree with the Dockerfile and tests/conftest.py on names."""

from __future__ import annotations

import re
import subprocess

import pytest

from .support import REPO, require_tool

pytestmark = pytest.mark.deploy

SCRIPTS = [REPO / "scripts" / "containers.sh", REPO / "scripts" / "release.sh", REPO / "scripts" / "oci-registry.sh",
           REPO / "scripts" / "schema-registry.sh",
           REPO / "scripts" / "images" / "kafka" / "run",
           REPO / "scripts" / "images" / "postgres" / "docker-entrypoint.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_shellcheck_clean(script: object) -> None:
    result = subprocess.run([require_tool("shellcheck"), "--severity=style", str(script)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_stand_in_base_carries_the_dockerfiles_from_name() -> None:
    """The stand-in is imported under the name the Dockerfile's FROM resolves to, so the build uses it."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "containers.sh"), "base-name"], capture_output=True,
                          text=True, timeout=30, check=True)
    version = re.search(r"^ARG PYTHON_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert version is not None
    assert done.stdout.strip() == f"docker.io/library/python:{version.group(1)}-slim-bookworm"


def test_testcontainers_run_uses_the_local_images_the_script_builds() -> None:
    makefile = (REPO / "Makefile").read_text()
    script = (REPO / "scripts" / "containers.sh").read_text()
    for variable in ("STOCK_LEDGER_KAFKA_IMAGE", "STOCK_LEDGER_POSTGRES_IMAGE"):
        in_make = re.search(rf"{variable}=(\S+)", makefile)
        in_script = re.search(rf'{variable}:-([^}}"]+)', script)
        assert in_make is not None
        assert in_script is not None
        assert in_make.group(1) == in_script.group(1).replace("$KAFKA_VERSION", "4.1.1")
