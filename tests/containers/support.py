"""podman from the tests: containers of the image that ships, labelled so that every one of them is removed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

IMAGE = os.environ.get("STOCK_LEDGER_IMAGE", "localhost/stock-ledger:dev")
# The archive CronJob's image (`make archive-image`): the same with pyarrow, tagged like the chart's default.
ARCHIVE_IMAGE = os.environ.get("STOCK_LEDGER_ARCHIVE_IMAGE", f"{IMAGE}-archive")
LABEL = "stock-ledger.test=true"
HINT = "run `make containers` (scripts/containers.sh image / archive-image / test-images) first"


def podman_path() -> str:
    found = shutil.which("podman")
    if found is None:
        pytest.fail(f"podman is not installed: {HINT}", pytrace=False)
    return found


def podman(*args: str, check: bool = True, timeout: float = 120,
           input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([podman_path(), *args], capture_output=True, text=True, timeout=timeout, check=False,
                          input=input_text)
    if check and done.returncode != 0:
        msg = f"podman {' '.join(args)} failed ({done.returncode}):\n{done.stderr}{done.stdout}"
        raise AssertionError(msg)
    return done


def require_image(name: str = IMAGE) -> str:
    if podman("image", "exists", name, check=False).returncode != 0:
        pytest.fail(f"image {name} is not in podman's store: {HINT}", pytrace=False)
    return name


@dataclass
class Containers:
    """Starts containers of the image with the production constraints; removes every one it started."""

    env: dict[str, str] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    image: str = IMAGE

    def run_args(self, name: str, env: dict[str, str], *, memory: str = "256m",
                 volumes: dict[str, str] | None = None) -> list[str]:
        args = [
            "--name", name, "--label", LABEL,
            # The chart's securityContext: read-only root (podman mounts a tmpfs on /tmp like the chart's
            # emptyDir), the image's numeric non-root uid, and the chart's default memory limit.
            "--read-only", "--user", "10001:10001", f"--memory={memory}",
            # The shared local Kafka and PostgreSQL listen on 127.0.0.1.
            "--network=host",
        ]
        for key, value in {**self.env, **env}.items():
            args += ["--env", f"{key}={value}"]
        for host, inside in (volumes or {}).items():  # a volume, like the chart's PVC
            args += ["--volume", f"{host}:{inside}:rw"]
        return args

    def run(self, *command: str, env: dict[str, str] | None = None, volumes: dict[str, str] | None = None,
            memory: str = "256m", timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """A subcommand run to completion in a fresh container, whatever its exit code."""
        name = f"sl-test-{uuid.uuid4().hex[:8]}"
        self.started.append(name)
        return podman("run", "--rm", *self.run_args(name, env or {}, memory=memory, volumes=volumes), self.image,
                      *command, check=False, timeout=timeout)

    def once(self, *command: str, env: dict[str, str] | None = None, volumes: dict[str, str] | None = None,
             memory: str = "256m", timeout: float = 180) -> str:
        """A subcommand run to completion in a fresh container; its output, or the failure with its logs."""
        done = self.run(*command, env=env, volumes=volumes, memory=memory, timeout=timeout)
        output = f"{done.stderr[-3000:]}{done.stdout[-3000:]}"
        assert done.returncode == 0, f"`{' '.join(command)}` in the image exited {done.returncode}:\n{output}"
        return done.stdout

    def start(self, *command: str, env: dict[str, str] | None = None, restart: bool = False,
              name: str | None = None) -> str:
        name = name or f"sl-test-{uuid.uuid4().hex[:8]}"
        self.started.append(name)
        extra = ["--restart=always"] if restart else []
        podman("run", "-d", *extra, *self.run_args(name, env or {}), self.image, *command)
        return name

    def inspect(self, name: str) -> dict[str, Any]:
        data = json.loads(podman("inspect", "--type", "container", name).stdout)
        assert isinstance(data, list)
        return dict(data[0])

    def state(self, name: str) -> dict[str, Any]:
        return dict(self.inspect(name)["State"])

    def wait_running(self, name: str, timeout: float, *, other_than_pid: int = 0) -> int:
        """The container's host PID once it runs (a new PID when other_than_pid is given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(name)
            if state.get("Running") and state.get("Pid", 0) not in {0, other_than_pid}:
                return int(state["Pid"])
            time.sleep(0.2)
        msg = f"container {name} did not (re)start within {timeout:g}s; state {self.state(name)}\n{self.logs(name)}"
        raise AssertionError(msg)

    def logs(self, name: str, tail: int = 60) -> str:
        done = podman("logs", "--tail", str(tail), name, check=False)
        return done.stdout + done.stderr

    def remove_all(self) -> None:
        for name in self.started:
            podman("rm", "-f", "-t", "0", name, check=False)
        self.started.clear()
