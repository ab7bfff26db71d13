"""Shell completion: `stock-ledger completion bash|zsh` prints scripts generated from the argument parser, and the
real shells complete every command, subcommand, flag and choice with them.

bash runs the completion function the way readline would (COMP_WORDS, COMP_CWORD); zsh runs in a pseudo-terminal
with compinit, and TAB runs the real `_arguments`/`_describe` machinery (a `compadd` wrapper prints what would be
offered, then the shell exits). zsh comes from Debian's package (scripts/tools.sh installs it): a missing zsh fails.
"""

from __future__ import annotations

import argparse
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest

from stock_ledger.cli import completion
from stock_ledger.cli.commands import COMMANDS, parser
from stock_ledger.domain import RejectCode

if TYPE_CHECKING:
    from pathlib import Path

PROG = "stock-ledger"
REASONS = sorted(c.value for c in RejectCode)
TOP = sorted(c.name for c in COMMANDS)
# Typed so far -> what TAB must offer, the same in both shells.
CASES = [
    pytest.param("stock-ledger ", TOP, id="commands"),
    pytest.param("stock-ledger off", ["offsets"], id="command-prefix"),
    pytest.param("stock-ledger --", ["--help", "--version"], id="top-level-flags"),
    pytest.param("stock-ledger offsets ", ["set", "show"], id="subcommands"),
    pytest.param("stock-ledger offsets set --to-", ["--to-log-end", "--to-log-start", "--to-timestamp"],
                 id="flag-prefix"),
    pytest.param("stock-ledger rejected list --reason ", REASONS, id="choices"),
    pytest.param("stock-ledger verify --wait 5 --j", ["--json"], id="after-a-flag-value"),
    pytest.param("stock-ledger completion ", ["bash", "zsh"], id="positional-choices"),
]


def bash_complete(script: str, line: str) -> list[str]:
    """What bash's completion function offers for `line` (the cursor at its end)."""
    words = line.split()
    if line.endswith(" "):
        words.append("")
    program = (f"{script}\nCOMP_WORDS=({' '.join(completion._bash_quote(w) for w in words)})\n"
               f"COMP_CWORD={len(words) - 1}\n_stock_ledger\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    done = subprocess.run(["bash", "--norc", "--noprofile"], input=program, capture_output=True, text=True,
                          timeout=30, check=True)
    assert not done.stderr, done.stderr
    return sorted(w for w in done.stdout.splitlines() if w)


ZSHRC = r"""
fpath=({dir} $fpath)
autoload -Uz compinit && compinit -u -d {dir}/.zcompdump
PROMPT='' RPROMPT=''
# TAB runs the normal completion (_main_complete) between two markers.
_offered() {{ print -r -- '<<<'; _main_complete; print -r -- '>>>' }}
zle -C offered complete-word _offered
bindkey '^I' offered
# Every candidate the completion functions add is printed; their internal queries (-O, -A, -D) pass through.
compadd() {{
    if [[ ${{@[1,(i)(-|--)]}} == *-(O|A|D)\ * ]]; then builtin compadd "$@"; return $?; fi
    local -a hits
    builtin compadd -A hits "$@"
    local h
    for h in $hits; do print -r -- "OFFERED:$h"; done
}}
print READY
"""


def zsh_complete(script: str, lines: list[str], home: Path) -> list[list[str]]:
    """What zsh offers when TAB is pressed after each of `lines` (the line is cleared between them), in one
    interactive zsh on a pseudo-terminal."""
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.fail("zsh is not installed: run scripts/tools.sh (it installs Debian's zsh)", pytrace=False)
    home.mkdir(exist_ok=True)
    (home / f"_{PROG}").write_text(script)
    (home / ".zshrc").write_text(ZSHRC.format(dir=home))
    pid, fd = pty.fork()
    if pid == 0:  # the child: the shell
        env = {"ZDOTDIR": str(home), "HOME": str(home), "TERM": "dumb", "PATH": os.environ.get("PATH", "")}
        os.execve(zsh, [zsh, "-i"], env)  # noqa: S606 - an interactive shell is what is tested
    output = b""

    def read_until(marker: bytes, count: int) -> None:
        nonlocal output
        deadline = time.monotonic() + 20
        while output.count(marker) < count and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return
                output += chunk

    try:
        read_until(b"READY", 1)
        for done, line in enumerate(lines, start=1):
            os.write(fd, b"\x15" + line.encode() + b"\t")  # ^U clears the previous line
            read_until(b">>>", done)
    finally:
        os.close(fd)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    text = output.decode(errors="replace")
    rounds = re.findall(r"<<<(.*?)>>>", text, flags=re.DOTALL)
    assert len(rounds) == len(lines), f"zsh completed {len(rounds)} of {len(lines)} lines:\n{text[-2000:]}"
    return [sorted({m.strip() for m in re.findall(r"OFFERED:(.*)", r)}) for r in rounds]


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    return {shell: completion.script(parser(), shell) for shell in completion.SHELLS}


@pytest.mark.parametrize(("line", "expected"), CASES)
def test_bash_completes(scripts: dict[str, str], line: str, expected: list[str]) -> None:
    assert bash_complete(scripts["bash"], line) == expected


def test_zsh_completes(scripts: dict[str, str], tmp_path: Path) -> None:
    lines = [case.values[0] for case in CASES]
    offered = zsh_complete(scripts["zsh"], lines, tmp_path / "zsh")
    assert dict(zip(lines, offered, strict=True)) == {case.values[0]: case.values[1] for case in CASES}


def test_a_flag_that_takes_a_free_value_offers_nothing(scripts: dict[str, str]) -> None:
    """After `--wait` comes a number: neither commands nor flags are offered (bash)."""
    assert bash_complete(scripts["bash"], "stock-ledger verify --wait ") == []


def command_paths() -> list[list[str]]:
    paths: list[list[str]] = []

    def walk(prefix: list[str], commands: tuple) -> None:  # type: ignore[type-arg]
        for c in commands:
            paths.append([*prefix, c.name])
            walk([*prefix, c.name], c.subcommands)

    walk([], COMMANDS)
    return paths


def test_every_command_offers_exactly_the_flags_its_help_lists(scripts: dict[str, str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """For each command of commands.py, bash offers the flags `stock-ledger <command> --help` lists, no more, no
    less: what completes is what the parser accepts."""
    for path in command_paths():
        with pytest.raises(SystemExit):
            parser().parse_args([*path, "--help"])
        shown = capsys.readouterr().out
        usage_and_options = shown.split("\n\n", 1)[0] + shown.partition("options:")[2].split("\n\n")[0]
        listed = sorted(set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage_and_options)))
        offered = [w for w in bash_complete(scripts["bash"], f"{PROG} {' '.join(path)} -") if w.startswith("-")]
        assert offered == listed, " ".join(path)


def test_generated_from_the_parser_it_is_given(tmp_path: Path) -> None:
    """Nothing is written by hand: a parser with other commands and flags completes those."""
    toy = argparse.ArgumentParser(prog=PROG)
    sub = toy.add_subparsers(dest="command")
    launch = sub.add_parser("launch", help="start it")
    launch.add_argument("--speed", choices=["slow", "fast"], help="how fast: [slow] or fast")
    launch.add_argument("--dry-run", action="store_true")
    script = completion.script(toy, "bash")
    assert bash_complete(script, "stock-ledger ") == ["launch"]
    assert bash_complete(script, "stock-ledger launch -") == ["--dry-run", "--help", "--speed", "-h"]
    assert bash_complete(script, "stock-ledger launch --speed ") == ["fast", "slow"]
    zsh = completion.script(toy, "zsh")
    assert zsh_complete(zsh, ["stock-ledger launch --speed ", "stock-ledger launch --d"], tmp_path / "zsh") == [
        ["fast", "slow"], ["--dry-run"]]


@pytest.mark.parametrize("shell", completion.SHELLS)
def test_the_command_prints_the_script(shell: str, scripts: dict[str, str]) -> None:
    """`stock-ledger completion SHELL` prints exactly the generated script; it needs no service and no variable."""
    env = {"PATH": os.environ.get("PATH", "")}
    done = subprocess.run([sys.executable, "-m", "stock_ledger", "completion", shell], capture_output=True, text=True,
                          timeout=60, check=False, env=env)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == scripts[shell]


def test_an_unknown_shell_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["completion", "fish"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "invalid choice: 'fish'" in error
    assert "'bash', 'zsh'" in error
