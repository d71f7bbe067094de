"""The CLI as a person meets it: in a real terminal (tmux) at 80 and 120 columns, in pipes,
with NO_COLOR, and `ac-observe top` live."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
import uuid

import httpx
import pytest

from ac_observe import metrics as m
from ac_observe.daemon.cli_render import human
from ac_observe.engine.telemetry import TelemetryWriter
from support.servers import AC_OBSERVE, EngineServer, run_cli, wait_for

HEADLINE = ("inference_latency_ns", "kv_cache_hit_rate", "skeleton_complexity",
            "cuda_stream_utilization")
# A stat cell of a headline table: a whole number of at most three significant digits,
# with the unit the table's title names (scaled for reading: ns may read as µs, ms or s).
_FIGURE = r"(\d+(\.\d+)?)"
CELL = {"ns": re.compile(rf"^{_FIGURE} (ns|µs|ms|s)$"), "%": re.compile(rf"^{_FIGURE}%$"),
        "levels": re.compile(rf"^{_FIGURE} lvl$")}
COUNT = re.compile(r"^\d+$")  # the last column, titled "n": samples in the window
ESCAPE = "\x1b["


class Tmux:
    """A detached tmux session of a given size running one shell command, on a tmux server
    of its own (-L): a new session never races the exit of the server a previous one's
    kill-session is shutting down ("server exited unexpectedly")."""

    def __init__(self, command: str, columns: int, rows: int = 50, env: dict | None = None):
        self.name = f"ac-{uuid.uuid4().hex[:8]}"
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
        subprocess.run([*self._tmux, "new-session", "-d", "-s", self.name, "-x", str(columns),
                        "-y", str(rows), f"{exports}{command}; sleep 600"], check=True)

    @property
    def _tmux(self) -> list[str]:
        return ["tmux", "-L", self.name]

    def screen(self, escapes: bool = False) -> str:
        args = [*self._tmux, "capture-pane", "-p", "-t", self.name] + (["-e"] if escapes
                                                                        else [])
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run([*self._tmux, "send-keys", "-t", self.name, *keys], check=True)

    def close(self) -> None:
        subprocess.run([*self._tmux, "kill-server"], capture_output=True)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A daemon and an engine that served traffic on both lanes, then went quiet."""
    from support.servers import DaemonProcess
    root = tmp_path_factory.mktemp("terminal") / "telemetry"
    root.mkdir()
    daemon = DaemonProcess(root, "--collectors", "engine").wait_ready()
    engine = EngineServer(root / "e1", "--engine-name", "e1").wait_ready()
    system = "<rules>Answer briefly.</rules> " * 10
    for i in range(24):
        response = httpx.post(engine.url + "/v1/messages", timeout=60,
                              headers={"x-ac-stream": m.LANES[i % 2]}, json={
                                  "model": "tiny", "max_tokens": 6, "system": system,
                                  "messages": [{"role": "user",
                                                "content": f"# Q{i}\n- <b>{i}</b>"}]})
        assert response.status_code == 200
    time.sleep(2.5)
    yield daemon
    engine.stop()
    daemon.stop()


def _data_lines(screen: str) -> list[list[str]]:
    """The number rows of a metric table: the cells that start like a number (or stand for
    none), split on runs of spaces or on the single space before a number."""
    rows = []
    for line in screen.splitlines():
        cells = [c for c in re.split(r"\s{2,}|(?<=\S) (?=\d|-|∞)", line.strip()) if c]
        numeric = [c for c in cells if c[:1].isdigit() or c in ("-", "∞")]
        if len(numeric) >= 3:
            rows.append(numeric)
    return rows


@pytest.mark.parametrize("columns", [80, 120])
def test_tables_fit_with_complete_numbers_and_whole_labels(live, columns):
    for metric in HEADLINE:
        answer = json.loads(run_cli("--daemon", live.url, "--metric", metric, "--window", "5m",
                                    "--json").stdout)
        tmux = Tmux(f"{AC_OBSERVE} --daemon {live.url} --metric {metric} --window 5m", columns)
        try:
            screen = wait_for(lambda: (s := tmux.screen()) and "over 300s" in s and
                              ("stream=" in s or "all" in s) and s, 20, metric)
        finally:
            tmux.close()
        assert "…" not in screen, screen
        # The title names the metric's raw unit; every figure below is in it, scaled.
        unit = m.FRIENDLY[metric].unit
        assert answer["unit"] == unit and f"(unit {unit}, scaled for reading)" in screen, \
            screen
        assert re.search(r"\bmin≤? .* p50 .* n(\s|$)", screen, re.MULTILINE), screen  # its columns
        rows = _data_lines(screen)
        assert len(rows) == len(answer["series"]) > 0, (metric, columns, rows, screen)
        for row in rows:
            # Six figures with their unit (min, mean, p50, p95, max, last), then the count.
            assert len(row) == 7, (metric, columns, row, screen)
            for cell in row[:6]:
                assert CELL[unit].match(cell), (metric, columns, cell, screen)
                number = CELL[unit].match(cell).group(1)
                digits = number.replace(".", "").lstrip("0")
                if "." not in number:
                    digits = digits.rstrip("0")
                assert len(digits) <= 3, (metric, columns, cell)  # three significant digits
            assert COUNT.match(row[6]), (metric, columns, row, screen)
        if metric in ("inference_latency_ns", "cuda_stream_utilization"):
            for lane in m.LANES:  # label values whole, never cut
                assert f"stream={lane}" in screen, screen
        if metric == "inference_latency_ns":
            assert re.search(r"\d+(\.\d+)? ms", screen), screen  # ns scaled to ms


def test_piped_output_is_plain_and_no_color_is_respected(live):
    piped = run_cli("--daemon", live.url, "--metric", "inference_latency_ns", "--window", "5m")
    assert piped.returncode == 0 and ESCAPE not in piped.stdout and "ms" in piped.stdout
    top = run_cli("--daemon", live.url, "top", "--window", "5m")
    assert top.returncode == 0 and ESCAPE not in top.stdout and "low_latency" in top.stdout
    colours = {}
    for no_color in ("", "1"):  # in colour by default (the check is not blind), then not
        tmux = Tmux(f"{AC_OBSERVE} --daemon {live.url} --metric kv_cache_hit_rate "
                    "--window 5m", 100, env={"NO_COLOR": no_color} if no_color else {})
        try:
            screen = wait_for(lambda: (s := tmux.screen(escapes=True)) and "over 300s" in s
                              and "%" in s and s, 20, "the table")
        finally:
            tmux.close()
        codes = [c for sgr in re.findall(r"\x1b\[([0-9;]*)m", screen) for c in sgr.split(";")]
        # Colour codes; 39 and 49 only reset to the terminal's defaults.
        colours[no_color] = [c for c in codes if re.fullmatch(r"3[0-8]|4[0-8]|9\d|10\d", c)]
    assert colours[""] and not colours["1"], colours


def test_a_rising_series_draws_a_rising_sparkline(start_daemon, tmp_path):
    root = tmp_path / "telemetry"
    daemon = start_daemon(root, "--collectors", "engine", "--interval", "0.5s")
    writer = TelemetryWriter(root / "e1", {"started_at": time.time()}, engine="e1", model="m")
    try:
        for step in range(24):  # KV usage climbing for 12 s
            writer.set(m.KV_USAGE, step / 24)
            time.sleep(0.5)
        answer = json.loads(run_cli("--daemon", daemon.url, "--metric", "kv_cache_usage",
                                    "--window", "12s", "--json").stdout)
        out = run_cli("--daemon", daemon.url, "--metric", "kv_cache_usage", "--window", "12s",
                      env={**os.environ, "COLUMNS": "120"})
    finally:
        writer.close()
    trend = [v for v in answer["series"][0]["trend"] if v is not None]
    assert trend == sorted(trend) and len(set(trend)) > 5
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("all")]
    spark = [c for c in row.split()[-1] if c in "▁▂▃▄▅▆▇█"]
    levels = ["▁▂▃▄▅▆▇█".index(c) for c in spark]
    assert levels == sorted(levels) and len(set(levels)) >= 4, row


# What `top` shows after a row's engine (and lane): (friendly name, statistic) per column.
LANE_COLUMNS = (("inference_latency_ns", "p50"), ("inference_latency_ns", "p95"),
                ("inter_token_latency_ms", "p95"), ("cuda_stream_utilization", "mean"),
                ("requests_running", "last"), ("requests_waiting", "last"))
ENGINE_COLUMNS = (("kv_cache_hit_rate", "mean"), ("kv_cache_usage", "last"),
                  ("skeleton_complexity", "p50"))
CYCLE_SECONDS = 1.0  # the daemon's collection interval (its default)


@pytest.fixture
def under_load(tmp_path):
    """A daemon and an engine sending itself demo traffic (`--demo-load`: concurrent clients
    on both lanes) the whole time, so the figures move from one cycle to the next."""
    from support.servers import DaemonProcess
    root = tmp_path / "loaded" / "telemetry"
    root.mkdir(parents=True)
    daemon = DaemonProcess(root, "--collectors", "engine").wait_ready()
    engine = EngineServer(root / "e2", "--engine-name", "e2", "--demo-load").wait_ready()
    try:
        wait_for(lambda: len(httpx.get(daemon.url + "/api/v1/query", timeout=10, params={
            "metric": "inference_latency_ns", "window": "5m"}).json()["series"]) == 2, 120,
            "demo traffic on both lanes")
        yield daemon
    finally:
        engine.stop()
        daemon.stop()


class Answers(threading.Thread):
    """The daemon's answers for every figure `top` shows, fetched round after round (many
    times per cycle) with the time each was asked and answered: GET /api/v1/query, the
    document `--json` prints (cli_query.show_metric)."""

    def __init__(self, url: str, window: str):
        super().__init__(daemon=True)
        self.url, self.window = url, window
        self.seen: list[tuple[float, float, str, dict]] = []  # (asked, answered, metric, body)
        self.done = threading.Event()

    def run(self) -> None:
        metrics = sorted({metric for metric, _ in LANE_COLUMNS + ENGINE_COLUMNS})
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.done.is_set():
                for metric in metrics:
                    asked = time.time()
                    body = client.get("/api/v1/query",
                                      params={"metric": metric, "window": self.window}).json()
                    self.seen.append((asked, time.time(), metric, body))

    def add(self, metric: str, asked: float, body: dict) -> None:
        self.seen.append((asked, time.time(), metric, body))

    def shown(self, metric: str, stat: str, where, since: float, until: float) -> set[str]:
        """How top would print the figure, for every answer fetched within [since, until]."""
        out = set()
        for asked, answered, name, body in self.seen:
            if name != metric or answered < since or asked > until:
                continue
            for series in body["series"]:
                labels = series["labels"]
                if (labels.get("engine"), labels.get("stream")) == where or (
                        labels.get("engine") == where and "stream" not in labels):
                    out.add(human(series[stat], body["unit"]))
        return out


def _rendered_at(screen: str) -> float:
    """When top drew this screen: the clock in its title (local time, to the second)."""
    hour, minute, second = map(int, re.search(r"ac-observe top (\d\d):(\d\d):(\d\d)",
                                              screen).groups())
    now = time.time()
    today = time.localtime(now)
    at = time.mktime((today.tm_year, today.tm_mon, today.tm_mday, hour, minute, second, 0, 0,
                      -1))
    return at - 86400 if at > now + 3600 else at  # drawn just before midnight


def test_top_shows_the_figures_of_the_json_answers_and_exits_cleanly(under_load, tmp_path):
    """Under live demo load, every figure on top's screen equals what the daemon answered
    (`--json`) for the same window within one cycle of the moment top drew it."""
    url = under_load.url
    exit_file = tmp_path / "exit"
    stty = tmp_path / "stty"
    answers = Answers(url, "5m")
    answers.start()
    tmux = Tmux(f"stty -g > {stty}.before; {AC_OBSERVE} --daemon {url} top "
                f"--window 5m; echo $? > {exit_file}; stty -g > {stty}.after", 80, 40)
    try:
        wait_for(lambda: (s := tmux.screen()) and "lanes" in s and "engines" in s
                 and "low_latency" in s and "throughput" in s and "alive" in s, 60,
                 "top's screen")
        asked = time.time()
        answers.add("inference_latency_ns", asked, json.loads(run_cli(
            "--daemon", url, "--metric", "inference_latency_ns", "--window", "5m",
            "--json").stdout))
        time.sleep(CYCLE_SECONDS + 0.5)  # top draws again after that answer
        screen = tmux.screen()
        asked = time.time()
        answers.add("inference_latency_ns", asked, json.loads(run_cli(
            "--daemon", url, "--metric", "inference_latency_ns", "--window", "5m",
            "--json").stdout))
        time.sleep(CYCLE_SECONDS + 0.5)
        answers.done.set()
        answers.join(timeout=30)
        # The load really flowed while top ran: requests kept finishing.
        counts = [sum(s["samples"] for s in body["series"]) for _, _, metric, body in
                  answers.seen if metric == "inference_latency_ns"]
        assert counts[-1] > counts[0], counts
        # top's snapshot was taken in the second its title shows (its queries take a moment
        # before it draws); answers from one cycle either side of that are accepted.
        drawn = _rendered_at(screen)
        since, until = drawn - 1.0 - CYCLE_SECONDS, drawn + 1.0 + CYCLE_SECONDS
        rows = [re.split(r"\s{2,}", line.strip()) for line in screen.splitlines()]
        lanes = {row[1]: row[2:] for row in rows if row[0] == "e2" and row[1:2] and
                 row[1] in m.LANES}
        assert set(lanes) == set(m.LANES), screen
        checked = 0
        for lane, cells in lanes.items():
            assert len(cells) == len(LANE_COLUMNS), (cells, screen)
            for cell, (metric, stat) in zip(cells, LANE_COLUMNS):
                expected = answers.shown(metric, stat, ("e2", lane), since, until)
                assert cell in expected, (lane, metric, stat, cell, expected, screen)
                checked += 1
        (engine,) = [row[1:-1] for row in rows if row[0] == "e2" and row[-1] == "alive"]
        assert len(engine) == len(ENGINE_COLUMNS), screen
        for cell, (metric, stat) in zip(engine, ENGINE_COLUMNS):
            expected = answers.shown(metric, stat, "e2", since, until)
            assert cell in expected, (metric, stat, cell, expected, screen)
            checked += 1
        assert checked == 2 * len(LANE_COLUMNS) + len(ENGINE_COLUMNS)
        assert "window 5m" in screen
        tmux.keys("w")  # the window changes on a key
        wait_for(lambda: "window 15m" in tmux.screen(), 10, "the next window")
        tmux.keys("C-c")
        wait_for(lambda: exit_file.exists() and exit_file.read_text().strip(), 10, "exit")
        assert exit_file.read_text().strip() == "0"
        wait_for(lambda: (stty.parent / "stty.after").exists(), 10, "stty")
        assert (stty.parent / "stty.after").read_text() == \
            (stty.parent / "stty.before").read_text()  # the terminal is as it was
    finally:
        answers.done.set()
        tmux.close()


def test_top_says_in_one_line_when_the_daemon_goes_away(start_daemon, tmp_path):
    daemon = start_daemon(None, "--collectors", "engine")
    out_file = tmp_path / "out"
    tmux = Tmux(f"{AC_OBSERVE} --daemon {daemon.url} top 2> {out_file}; echo $? >> {out_file}",
                80, 30)
    try:
        wait_for(lambda: "lanes" in tmux.screen(), 30, "top's screen")
        daemon.stop()
        wait_for(lambda: out_file.exists() and out_file.read_text().strip().endswith("1"), 15,
                 "top to exit")
    finally:
        tmux.close()
    lines = out_file.read_text().strip().splitlines()
    assert len(lines) == 2 and "cannot reach the ac-observe daemon" in lines[0], lines
    assert "Traceback" not in out_file.read_text()
