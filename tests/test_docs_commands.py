"""The docs hold what runs: every `ac-observe` command in a fenced ```bash or ```console
block of README.md and docs/*.md runs against a live daemon and exits as the docs say, and
every relative link of the README, ARCHITECTURE.md and docs/ names a file (and a heading)
that exists.

A command is a line of a bash block that starts with `ac-observe `, or a line of either
kind of block that starts with `$ ac-observe ` (a console block's other lines are its
output). It runs in bash from a folder that stands in for the repository's root (a copy of
its dashboards/, an alerting file `alerts.yaml` whose receiver answers, a
request body `request.json`), with AC_OBSERVE_URL pointing at the daemon, and must exit 0
within 60 s, or the code its trailing comment names (`# exit 1: ...`). Commands that run
until stopped (`up`, `daemon`, `engine`, `top`, `gateway`, `--watch`) are left out, and so
is one whose line ends in `# not run by the docs test` (it needs what no test here has,
such as a real Grafana or the compose stack's token).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from support.servers import AC_OBSERVE

REPO = Path(__file__).resolve().parents[1]
COMMAND_PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
LINKED_PAGES = (REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").glob("*.md")))

NOT_RUN = "# not run by the docs test"
RUNS_UNTIL_STOPPED = {"up", "daemon", "engine", "top", "gateway"}
# The root callback's options that take a value (the subcommand is the first other word).
VALUE_OPTIONS = {"--metric", "-m", "--window", "-w", "--labels", "-l", "--at", "--daemon",
                 "--token", "--token-file", "--cacert", "--cert", "--key"}
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<", "<<<", "2>", "&"}
EXPECTED_EXIT = re.compile(r"\s#\s*exits? (\d+)\b")
COMMAND_SECONDS = 60

FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str

    @property
    def expected_exit(self) -> int:
        found = EXPECTED_EXIT.search(self.text)
        return int(found.group(1)) if found else 0

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def fenced_blocks(text: str):
    """(language, [(line number, line)]) of each fenced block; continuation lines (a
    trailing backslash) joined onto the line they continue."""
    language, lines = None, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence and language is None:
            language, lines = fence.group(1), []
        elif line.startswith("```") and language is not None:
            yield language, lines
            language = None
        elif language is not None:
            if lines and lines[-1][1].endswith("\\"):
                lines[-1] = (lines[-1][0], lines[-1][1][:-1].rstrip() + " " + line.strip())
            else:
                lines.append((number, line))


def documented_commands(pages=COMMAND_PAGES) -> list[Command]:
    commands = []
    for page in pages:
        for language, lines in fenced_blocks(page.read_text(encoding="utf-8")):
            if language not in ("bash", "console"):
                continue
            for number, line in lines:
                if line.startswith("$ ac-observe "):
                    line = line[2:]
                elif not (language == "bash" and line.startswith("ac-observe ")):
                    continue
                commands.append(Command(str(page.relative_to(REPO)), number, line.strip()))
    return commands


def runs_to_the_end(command: str) -> bool:
    """False for a command that serves or watches until stopped, or is marked not run."""
    if command.endswith(NOT_RUN):
        return False
    words = []
    for word in shlex.split(command, comments=True):
        if word in SHELL_OPERATORS:
            break
        words.append(word)
    if "--watch" in words:
        return False
    rest = iter(words[1:])
    for word in rest:
        if word in VALUE_OPTIONS:
            next(rest, None)
        elif not word.startswith("-"):
            return word not in RUNS_UNTIL_STOPPED
    return True


def test_the_extraction_finds_commands_and_leaves_out_the_long_running():
    commands = [c.text for c in documented_commands()]
    assert "ac-observe --metric cuda_stream_utilization --window 60s" in commands  # README
    assert any(c.startswith("ac-observe alerts test") for c in commands)
    assert not runs_to_the_end("ac-observe daemon --alerting alerts.yaml")
    assert not runs_to_the_end("ac-observe --metric skeleton_complexity --watch")
    assert not runs_to_the_end("ac-observe --daemon http://h:9410 top")
    assert not runs_to_the_end(f"ac-observe dashboards push --grafana-url x  {NOT_RUN}")
    assert runs_to_the_end("ac-observe --metric engine_up --labels engine=up")
    assert runs_to_the_end("ac-observe alerts defaults > alerts.yaml")
    assert Command("x", 1, "ac-observe --metric nope   # exit 1: unknown").expected_exit == 1


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, seen = set(), {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_relative_link_names_a_file_and_heading_that_exist():
    broken = []
    for page in LINKED_PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"),
                      flags=re.S | re.M)  # links inside code are not links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


class _AcceptingReceiver(BaseHTTPRequestHandler):
    """A webhook receiver that acknowledges every delivery."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _stand_in_root(folder: Path, receiver_url: str) -> dict[str, str]:
    """The repository's files the commands read, and the files the docs name; returns the
    files a command may overwrite, to be put back before the next one."""
    shutil.copytree(REPO / "dashboards", folder / "dashboards")
    return {
        "alerts.yaml": f"rules: defaults\nreceivers:\n  - name: ops\n    url: {receiver_url}\n",
        "request.json": json.dumps({
            "model": "tiny", "max_tokens": 16, "system": "You are terse.",
            "messages": [{"role": "user", "content": "<doc><title>x</title></doc>\nSum up."}]}),
    }


@pytest.mark.slow
def test_every_documented_command_runs(start_daemon, tmp_path):
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _AcceptingReceiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        root = tmp_path / "root"
        root.mkdir()
        files = _stand_in_root(root, f"http://127.0.0.1:{receiver.server_port}/hook")
        for name, content in files.items():
            (root / name).write_text(content)
        daemon = start_daemon(None, "--collectors", "engine", "--alerting",
                              str(root / "alerts.yaml"))
        env = {**os.environ, "AC_OBSERVE_URL": daemon.url, "COLUMNS": "100",
               "PATH": f"{Path(AC_OBSERVE).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        commands = [c for c in documented_commands() if runs_to_the_end(c.text)]
        assert len(commands) >= 20, [str(c) for c in commands]
        failed = []
        for command in commands:
            for name, content in files.items():  # as the docs left them, whatever ran before
                (root / name).write_text(content)
            try:
                done = subprocess.run(["bash", "-c", command.text], cwd=root, env=env,
                                      capture_output=True, text=True, timeout=COMMAND_SECONDS)
            except subprocess.TimeoutExpired:
                failed.append(f"{command}\n  still running after {COMMAND_SECONDS} s")
                continue
            if done.returncode != command.expected_exit:
                failed.append(f"{command}\n  exit {done.returncode}, the docs say "
                              f"{command.expected_exit}\n  {done.stderr.strip()[-600:]}")
        assert not failed, "\n".join(failed)
    finally:
        receiver.shutdown()
        receiver.server_close()
