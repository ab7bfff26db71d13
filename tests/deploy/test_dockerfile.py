"""The Dockerfile's rules, checked by parsing it: no Docker engine runs here.

hadolint, the usual Dockerfile linter, cannot be installed here: it is not packaged in Debian bookworm and its
GitHub release binaries cannot be downloaded (only package registries are reachable). These tests check the
rules this project cares about instead.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

import pytest

from .support import REPO

pytestmark = pytest.mark.deploy

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form ENTRYPOINT/CMD/RUN, or None for the shell form."""
        if not self.args.startswith("["):
            return None
        parsed = json.loads(self.args)
        assert isinstance(parsed, list), f"line {self.line}: {self.keyword} JSON form must be an array"
        return [str(item) for item in parsed]

    def flags_and_operands(self) -> tuple[dict[str, str], list[str]]:
        """`--flag=value` options and the remaining words of a COPY/ADD/FROM."""
        flags: dict[str, str] = {}
        operands: list[str] = []
        for word in shlex.split(self.args):
            if word.startswith("--") and not operands:
                name, _, value = word[2:].partition("=")
                flags[name] = value
            else:
                operands.append(word)
        return flags, operands


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"stage {self.name or self.image} has no {keyword}"
        return found[-1]


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Joins backslash continuations and drops comments and blank lines; keeps the starting line number."""
    lines: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continuation are skipped by Docker too
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        lines.append((start, " ".join(part for part in pending if part)))
        pending = []
    assert not pending, "Dockerfile ends inside a line continuation"
    return lines


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults (those before the first FROM) and the build stages."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        instruction = Instruction(keyword.upper(), rest.strip(), number)
        if instruction.keyword == "FROM":
            _, operands = instruction.flags_and_operands()
            image = substitute(operands[0], global_args)
            name = operands[2] if len(operands) == 3 and operands[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        elif not stages:
            assert instruction.keyword == "ARG", f"line {number}: only ARG may precede the first FROM"
            arg_name, _, default = instruction.args.partition("=")
            global_args[arg_name] = default.strip('"')
        else:
            stages[-1].instructions.append(instruction)
    return global_args, stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    assert DOCKERFILE.is_file(), f"{DOCKERFILE} is missing"
    return parse(DOCKERFILE.read_text())[1]


@pytest.fixture(scope="module")
def final(stages: list[Stage]) -> Stage:
    return stages[-1]


def label_keys(stage: Stage) -> set[str]:
    keys: set[str] = set()
    for instruction in stage.all("LABEL"):
        keys.update(word.partition("=")[0] for word in shlex.split(instruction.args))
    return keys


def env_values(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in stage.all("ENV"):
        for word in shlex.split(instruction.args):
            key, _, value = word.partition("=")
            env[key] = value
    return env


class TestBaseImages:
    """Each stage builds FROM a pinned python slim-bookworm release or an earlier stage; never `latest`."""

    def test_multi_stage(self, stages: list[Stage]) -> None:
        assert len(stages) >= 2, "the Dockerfile must be multi-stage (build + runtime)"
        assert all(stage.name for stage in stages), "name every stage (FROM ... AS name)"

    def test_base_images_pinned_to_a_patch_release(self, stages: list[Stage]) -> None:
        earlier: set[str] = set()
        for stage in stages:
            if stage.image in earlier:
                continue
            assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[a-f0-9]{64})?", stage.image), (
                f"FROM {stage.image}: pin python:3.11.<patch>-slim-bookworm"
            )
            assert stage.name is not None
            earlier.add(stage.name)

    def test_no_latest(self) -> None:
        assert not re.search(r":latest\b", DOCKERFILE.read_text()), "no image may be tagged latest"


class TestRuntimeStage:
    """The image that ships: non-root, entrypoint, labels, environment, contents."""

    def test_user_is_numeric_and_not_root(self, final: Stage) -> None:
        user, _, group = final.last("USER").args.partition(":")
        assert user.isdigit(), "USER must be a numeric uid so runAsNonRoot can verify it"
        assert int(user) != 0, "USER must not be root"
        assert not group or group.isdigit(), "the USER group must be a numeric gid"

    def test_user_switch_comes_after_every_run(self, final: Stage) -> None:
        user_line = final.last("USER").line
        assert all(run.line < user_line for run in final.all("RUN")), "nothing may run as root after USER"

    def test_entrypoint_and_default_command(self, final: Stage) -> None:
        assert final.last("ENTRYPOINT").exec_form() == ["stock-ledger"], 'use ENTRYPOINT ["stock-ledger"]'
        assert final.last("CMD").exec_form() == ["run"], 'use CMD ["run"]'

    def test_oci_labels(self, final: Stage) -> None:
        required = {
            f"org.opencontainers.image.{key}"
            for key in ("title", "description", "version", "revision", "source", "base.name")
        }
        assert required <= label_keys(final), f"missing OCI labels: {sorted(required - label_keys(final))}"

    def test_environment(self, final: Stage) -> None:
        env = env_values(final)
        assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
        assert env.get("PYTHONUNBUFFERED") == "1"
        assert env.get("STOCK_LEDGER_MIGRATIONS_DIR") == "/app/migrations"

    def test_exposes_metrics_port(self, final: Stage) -> None:
        assert "9108" in {port.split("/")[0] for i in final.all("EXPOSE") for port in i.args.split()}

    def test_ships_migrations_and_chaos_script(self, final: Stage) -> None:
        destinations = {
            operands[-1].rstrip("/"): operands[:-1]
            for flags, operands in (i.flags_and_operands() for i in final.all("COPY"))
            if "from" not in flags
        }
        assert destinations.get("/app/migrations") == ["migrations/"]
        assert destinations.get("/app/scripts/chaos.sh") == ["scripts/chaos.sh"]

    def test_application_files_not_owned_by_the_runtime_user(self, final: Stage) -> None:
        """Root-owned code: a compromised worker cannot rewrite itself (nothing needs writing but /tmp)."""
        for instruction in final.all("COPY"):
            flags, _ = instruction.flags_and_operands()
            assert "chown" not in flags, f"line {instruction.line}: keep application files root-owned"


class TestBuildStage:
    """Dependencies form their own layer, built from pyproject.toml alone."""

    def test_dependencies_layer_precedes_the_source(self, stages: list[Stage]) -> None:
        build = stages[0]
        copies = [i.flags_and_operands()[1] for i in build.all("COPY")]
        assert copies, "the build stage copies nothing"
        assert copies[0][:-1] == ["pyproject.toml", "requirements.lock", "requirements-archive.lock"], (
            "copy pyproject.toml and the locks alone first (dependency layer)"
        )
        first_copy = build.all("COPY")[0].line
        source_copy = build.all("COPY")[1].line
        installs = [i for i in build.all("RUN") if "pip install" in i.args]
        assert any(first_copy < i.line < source_copy for i in installs), (
            "install dependencies before copying src"
        )

    def test_dependencies_come_from_the_lock_with_hashes(self, stages: list[Stage]) -> None:
        """Every dependency is checked against requirements.lock's hashes; nothing else resolves them."""
        installs = [i.args for i in stages[0].all("RUN") if "pip install" in i.args and "-r " in i.args]
        assert len(installs) == 1, "install dependencies once, from requirements.lock"
        assert "--require-hashes" in installs[0], "install with `pip install --require-hashes`"
        assert '-r "$LOCK"' in installs[0]
        # the worker's image by default; requirements-archive.lock (the archive image) only when asked for
        assert [i.args for i in stages[0].all("ARG")] == ["LOCK=requirements.lock"]

    def test_the_venv_ships_without_pip_and_setuptools(self, stages: list[Stage]) -> None:
        last = stages[0].all("RUN")[-1].args
        assert re.search(r"pip uninstall .*\bpip\b.*\bsetuptools\b", last), (
            "the build stage's last step removes pip and setuptools from the venv the runtime copies"
        )

    def test_runtime_takes_only_the_venv_from_the_build(self, final: Stage, stages: list[Stage]) -> None:
        from_build = [
            i.flags_and_operands() for i in final.all("COPY") if "from" in i.flags_and_operands()[0]
        ]
        assert from_build == [({"from": stages[0].name or ""}, ["/opt/venv", "/opt/venv"])]


class TestHygiene:
    """No remote ADD, a build context that leaves the repo's clutter and secrets out."""

    def test_no_add_of_urls(self, stages: list[Stage]) -> None:
        for stage in stages:
            for instruction in stage.all("ADD"):
                _, operands = instruction.flags_and_operands()
                remote = [src for src in operands[:-1] if re.match(r"^(https?|git)://|^git@", src)]
                assert not remote, f"line {instruction.line}: ADD of a URL; fetch in a RUN with a checksum"

    def test_dockerignore_is_an_allowlist(self) -> None:
        patterns = [
            line.strip()
            for line in DOCKERIGNORE.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        assert patterns[0] == "*", ".dockerignore must exclude everything first, then re-include"
        included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
        assert {"pyproject.toml", "requirements.lock", "src", "migrations", "scripts/chaos.sh"} <= included
        assert not included & {".venv", ".git", "tests"}


def test_parser_reads_continuations_and_args() -> None:
    """The parser itself: continuations, comments inside them, global ARG substitution, exec form."""
    text = (
        "ARG V=3.11.9\nFROM python:${V}-slim-bookworm AS a\n"
        'RUN echo one \\\n  # a comment\n  two\nENTRYPOINT ["x"]\n'
    )
    global_args, parsed = parse(text)
    assert global_args == {"V": "3.11.9"}
    assert parsed[0].image == "python:3.11.9-slim-bookworm"
    assert parsed[0].last("RUN").args == "echo one two"
    assert parsed[0].last("ENTRYPOINT").exec_form() == ["x"]
