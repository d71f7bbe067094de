"""The CLI as a person meets it: in a real terminal (tmux) at 80 and 120 columns, in pipes,
with NO_COLOR, and `ac-observe top` live."""
from __future__ import annotations

import io
import json
import os
import re
import select
import shlex
import subprocess
import time
import uuid

import httpx
import pytest

from ac_observe import metrics as m
from ac_observe.daemon.cli.render import human
from ac_observe.daemon.cli.top import LANE_COLUMNS
from ac_observe.engine.telemetry import TelemetryWriter
from support.servers import AC_OBSERVE, EngineServer, free_port, run_cli, sample_value, wait_for

HEADLINE = ("inference_latency_ns", "kv_cache_hit_rate", "skeleton_complexity",
            "cuda_stream_utilization")
WITH_UNIT = re.compile(r"^\d+(\.\d+)?(k|M|G)?( ?(ns|µs|ms|s|%|lvl|req))$")
ESCAPE = "\x1b["


class Tmux:
    """A detached tmux session of a given size running one shell command.

    Each session runs on its own tmux server (its own socket): sessions sharing the default
    server race its exit when the last one closes ("server exited unexpectedly")."""

    def __init__(self, command: str, columns: int, rows: int = 50, env: dict | None = None):
        self.name = f"ac-{uuid.uuid4().hex[:8]}"
        self.tmux = ["tmux", "-L", self.name, "-f", "/dev/null"]
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
        subprocess.run(self.tmux + ["new-session", "-d", "-s", self.name, "-x", str(columns),
                                    "-y", str(rows), f"{exports}{command}; sleep 600"],
                       check=True)

    def screen(self, escapes: bool = False) -> str:
        args = self.tmux + ["capture-pane", "-p", "-t", self.name] + (["-e"] if escapes else [])
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(self.tmux + ["send-keys", "-t", self.name, *keys], check=True)

    def close(self) -> None:
        subprocess.run(self.tmux + ["kill-server"], capture_output=True)


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
    wait_for(lambda: sum(sample_value(daemon.metrics(), "ac_requests_total", engine="e1",
                                      stream=lane, status="ok") or 0 for lane in m.LANES) == 24,
             20, "the daemon to see every request")
    daemon.wait_cycles(2)  # quiet cycles after the traffic
    yield daemon
    engine.stop()
    daemon.stop()


def _data_lines(screen: str) -> list[list[str]]:
    """The number rows of a metric table: cells split on runs of spaces."""
    rows = []
    for line in screen.splitlines():
        cells = [c for c in re.split(r"\s{2,}|(?<=\S) (?=\d|-|∞)", line.strip()) if c]
        numeric = [c for c in cells if c[:1].isdigit() or c in ("-", "∞")]
        if len(numeric) >= 6:
            rows.append(numeric)
    return rows


@pytest.mark.stack
@pytest.mark.parametrize("columns", [80, 120])
def test_tables_fit_with_complete_numbers_and_whole_labels(live, columns):
    for metric in HEADLINE:
        tmux = Tmux(f"{AC_OBSERVE} --daemon {live.url} --metric {metric} --window 5m", columns)
        try:
            screen = wait_for(lambda tmux=tmux: (s := tmux.screen()) and "over 300s" in s
                              and ("stream=" in s or "all" in s) and s, 20, metric)
        finally:
            tmux.close()
        assert "…" not in screen, screen
        rows = _data_lines(screen)
        assert rows, screen
        for row in rows:  # six statistics, each with its unit, then the sample count
            *stats, count = row
            assert len(stats) == 6 and count.isdigit(), (metric, columns, row, screen)
            for cell in stats:
                assert cell in ("-", "∞") or WITH_UNIT.match(cell), (metric, columns, cell,
                                                                      screen)
            assert any(re.search(r"\d", c) for c in row)
        if metric in ("inference_latency_ns", "cuda_stream_utilization"):
            for lane in m.LANES:  # label values whole, never cut
                assert f"stream={lane}" in screen, screen
        if metric == "inference_latency_ns":
            assert re.search(r"\d+(\.\d+)? ms", screen), screen  # ns scaled to ms


@pytest.mark.stack
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
            screen = wait_for(lambda tmux=tmux: (s := tmux.screen(escapes=True))
                              and "over 300s" in s and "%" in s and s, 20, "the table")
        finally:
            tmux.close()
        codes = [c for sgr in re.findall(r"\x1b\[([0-9;]*)m", screen) for c in sgr.split(";")]
        # Colour codes; 39 and 49 only reset to the terminal's defaults.
        colours[no_color] = [c for c in codes if re.fullmatch(r"3[0-8]|4[0-8]|9\d|10\d", c)]
    assert colours[""] and not colours["1"], colours


@pytest.mark.slow
def test_watch_into_a_pipe_prints_a_stamped_frame_every_two_seconds(live):
    """`--watch | tee log`: Live redraws nothing off a terminal, so frames are printed one
    after another, each under its time, as they come (not held until the end)."""
    watch = subprocess.Popen([AC_OBSERVE, "--daemon", live.url, "--metric",
                              "kv_cache_hit_rate", "--window", "5m", "--watch"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 15
        while sum(line.startswith("--- ") for line in lines) < 3:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([watch.stdout], [], [], max(0.0, left))
            assert ready and left > 0, f"3 frames not printed within 15 s: {lines}"
            lines.append(watch.stdout.readline())
    finally:
        watch.kill()
        watch.communicate()
    frames = "".join(lines).split("--- ")[1:]
    assert all("kv_cache_hit_rate over 300s" in frame for frame in frames[:2]), lines
    assert ESCAPE not in "".join(lines) and "\n\n" not in "".join(lines)
    # `--watch | head -3`: the reader goes away, the CLI ends quietly.
    done = subprocess.run(f"{AC_OBSERVE} --daemon {live.url} --metric kv_cache_hit_rate "
                          "--window 5m --watch | head -3", shell=True, capture_output=True,
                          text=True, timeout=30)
    assert len(done.stdout.splitlines()) == 3 and done.stderr == "", done.stderr


def test_flat_trends_and_unitless_metrics_read_right():
    from ac_observe.daemon.cli.render import metric_table, sparkline
    assert sparkline([0, 0, None, 0]) == "▁▁ ▁"  # nothing happened: at the bottom
    assert sparkline([1, 1, 1]) == "▅▅▅"
    assert sparkline([0, 1]) == "▁█"
    answer = {"metric": "engine_up", "unit": "", "kind": "gauge", "window_seconds": 60,
              "series": []}
    assert str(metric_table(answer, 80)).splitlines()[0] == "engine_up over 60s"


@pytest.mark.slow
def test_a_rising_series_draws_a_rising_sparkline(start_daemon, tmp_path):
    root = tmp_path / "telemetry"
    daemon = start_daemon(root, "--collectors", "engine", "--interval", "0.5s")
    writer = TelemetryWriter(root / "e1", {"started_at": time.time()}, engine="e1", model="m")
    try:
        for step in range(24):  # KV usage climbing for 12 s
            writer.set(m.KV_USAGE, step / 24)
            time.sleep(0.5)
        # Both answers as of the ramp's end (a CLI's start-up under load would otherwise
        # slide its window past the ramp).
        end = f"{time.time():.3f}"
        answer = json.loads(run_cli("--daemon", daemon.url, "--metric", "kv_cache_usage",
                                    "--window", "12s", "--at", end, "--json").stdout)
        out = run_cli("--daemon", daemon.url, "--metric", "kv_cache_usage", "--window", "12s",
                      "--at", end, env={**os.environ, "COLUMNS": "120"})
    finally:
        writer.close()
    trend = [v for v in answer["series"][0]["trend"] if v is not None]
    assert trend == sorted(trend) and len(set(trend)) > 5
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("all")]
    spark = [c for c in row.split()[-1] if c in "▁▂▃▄▅▆▇█"]
    levels = ["▁▂▃▄▅▆▇█".index(c) for c in spark]
    assert levels == sorted(levels) and len(set(levels)) >= 4, row


@pytest.mark.stack
def test_top_shows_the_figures_of_the_json_answers_and_exits_cleanly(live, tmp_path):
    exit_file = tmp_path / "exit"
    stty = tmp_path / "stty"
    tmux = Tmux(f"stty -g > {stty}.before; {AC_OBSERVE} --daemon {live.url} top "
                f"--window 5m; echo $? > {exit_file}; stty -g > {stty}.after", 80, 40)
    try:
        screen = wait_for(lambda: (s := tmux.screen()) and "lanes" in s and "engines" in s
                          and "low_latency" in s and s, 30, "top's screen")
        ttft = json.loads(run_cli("--daemon", live.url, "--metric", "inference_latency_ns",
                                  "--window", "5m", "--json").stdout)
        hits = json.loads(run_cli("--daemon", live.url, "--metric", "kv_cache_hit_rate",
                                  "--window", "5m", "--json").stdout)
        for series in ttft["series"]:
            lane = series["labels"]["stream"]
            (line,) = [row for row in screen.splitlines() if f" {lane} " in f" {row} "]
            assert human(series["p50"], "ns") in line and human(series["p95"], "ns") in line
        (line,) = [row for row in screen.splitlines() if row.strip().startswith("e1") and
                   "alive" in row]
        assert human(hits["series"][0]["mean"], "%") in line
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
        tmux.close()


def _cells(line: str) -> list[str]:
    return [c for c in re.split(r"\s{2,}", line.strip()) if c]


def _answers_at(url: str, at: str) -> dict:
    """`--metric NAME --window 5m --json --at AT` for every figure `top` shows."""
    answers = {}
    for metric in ("inference_latency_ns", "inter_token_latency_ms", "cuda_stream_utilization",
                   "requests_running", "requests_waiting", "kv_cache_hit_rate",
                   "kv_cache_usage", "skeleton_complexity"):
        done = run_cli("--daemon", url, "--metric", metric, "--window", "5m", "--json",
                       "--at", at)
        assert done.returncode == 0, done.stderr
        answers[metric] = json.loads(done.stdout)
        assert answers[metric]["as_of"] == float(at)
    return answers


def _expected_rows(answers: dict) -> tuple[dict, dict]:
    """top's rows as the JSON answers say they must read: {(engine, lane): cells} for the
    engine's lanes table and {engine: cells} for the engines table."""
    def by(metric, stat, key):
        answer = answers[metric]
        return {key(s["labels"]): human(s[stat], answer["unit"]) for s in answer["series"]}
    lane = lambda labels: (labels["engine"], labels["stream"])  # noqa: E731
    engine = lambda labels: labels["engine"]  # noqa: E731
    columns = [by("inference_latency_ns", "p50", lane), by("inference_latency_ns", "p95", lane),
               by("inter_token_latency_ms", "p95", lane),
               by("cuda_stream_utilization", "mean", lane),
               by("requests_running", "last", lane), by("requests_waiting", "last", lane)]
    lanes = {k: [k[1]] + [c.get(k, "-") for c in columns] for k in columns[0]}
    columns = [by("kv_cache_hit_rate", "mean", engine), by("kv_cache_usage", "last", engine),
               by("skeleton_complexity", "p50", engine)]
    engines = {k: [k] + [c.get(k, "-") for c in columns] + ["alive"] for k in columns[0]}
    return lanes, engines


@pytest.mark.stack
@pytest.mark.slow
def test_top_under_demo_load_shows_exactly_the_json_answers_of_its_cycle(start_daemon,
                                                                         tmp_path):
    """While an engine serves demo traffic (every figure moves from cycle to cycle), each
    screen of `top` says which cycle it shows ("as of HH:MM:SS") and equals, cell for cell,
    the `--json` answers pinned to that cycle with `--at`."""
    root = tmp_path / "telemetry"
    rules = tmp_path / "alerts.yaml"
    rules.write_text("rules:\n  - {name: TtftAboveZero, metric: inference_latency_ns, "
                     "statistic: p50, window: 30s, comparison: above, threshold: 0, for: 1s, "
                     "match: {stream: throughput}}\n")
    daemon = start_daemon(root, "--collectors", "engine", "--alerting", str(rules))
    engine = EngineServer(root / "e1", "--engine-name", "e1", "--demo-load").wait_ready()
    tmux = Tmux(f"{AC_OBSERVE} --daemon {daemon.url} top --window 5m", 80, 40)
    try:
        wait_for(lambda: (s := tmux.screen()) and "lanes of e1" in s and " ms " in s and
                 all(f" {lane} " in s for lane in m.LANES), 90, "top's rows for both lanes")
        alert = wait_for(lambda: [r for r in map(_cells, tmux.screen().splitlines())
                                  if r[:2] == ["TtftAboveZero", "firing"]], 30, "the alert")
        assert WITH_UNIT.match(alert[0][2]) and alert[0][2].endswith("s"), alert  # 9.87 ms
        assert alert[0][3] == "0 ns", alert  # against its threshold
        shown = []
        deadline = time.monotonic() + 120
        while len(shown) < 3 and time.monotonic() < deadline:
            screen = tmux.screen()
            if tmux.screen() != screen:  # caught mid-redraw
                continue
            clock = re.search(r"as of (\d\d):(\d\d):(\d\d)", screen)
            assert clock, screen
            day = time.localtime()
            second = time.mktime((day.tm_year, day.tm_mon, day.tm_mday,
                                  *map(int, clock.groups()), 0, 0, -1))
            if second > time.time() + 1:  # shown before midnight, read after it
                second -= 86400
            # The cycle it shows: the newest at or before the end of that second, unless
            # two cycles fell in that second (then which one is ambiguous: look again).
            def as_of(at):
                return httpx.get(daemon.url + "/api/v1/query", params={
                    "metric": "kv_cache_usage", "window": "5m", "at": repr(at)}).json()["as_of"]
            cycle = as_of(second + 0.999999)
            if cycle is None or int(cycle) != int(second) or \
                    (as_of(cycle - 1e-6) or 0) >= second:
                time.sleep(0.3)
                continue
            lanes, engines = _expected_rows(_answers_at(daemon.url, repr(cycle)))
            rows = [_cells(line) for line in screen.splitlines()]
            assert list(LANE_COLUMNS) in rows, screen  # whole headers at 80 columns
            for (engine_name, _), cells in lanes.items():  # in the table of its engine
                assert rows.index(cells) > rows.index([f"lanes of {engine_name}"]), screen
            for cells in engines.values():
                assert cells in rows, (cells, screen)
            shown.append((cycle, sorted(map(tuple, lanes.values()))))
            time.sleep(1.5)
        assert len(shown) == 3, "no three screens whose cycle could be told"
        assert len({cycle for cycle, _ in shown}) == 3  # the screen moved on between looks
        assert len({str(rows) for _, rows in shown}) > 1, shown  # and the figures with it
    finally:
        tmux.close()
        engine.stop()


@pytest.mark.parametrize("columns", [60, 80])
def test_top_keeps_headers_numbers_and_names_whole(columns):
    """Wide figures in every column and a long engine name at 80 columns, and at 60 where
    the lanes split into a latency and a load table: every header and number stays whole
    (a long name may wrap)."""
    from rich.console import Console

    from ac_observe.daemon.cli.top import render
    name = "prod-engine-with-a-long-name-7"
    key = (name, "low_latency")
    wide = {"ttft_p50": "1.05 s", "ttft_p95": "12.3 s", "itl_p95": "999 ms", "util": "99.9%",
            "running": "1.50k req", "waiting": "12.3k req"}
    snap = {"figures": {**{f: {key: v} for f, v in wide.items()},
                        "hit": {name: "88.8%"}, "usage": {name: "99.9%"},
                        "skeleton": {name: "12.5 lvl"}, "gpu_util": {}, "sm": {}},
            "collectors": [{"name": "engine", "up": True}], "window": "5m",
            "engines": [{"engine": name, "alive": True}], "as_of": time.time(),
            "alerts": {"rules": 0, "alerts": []}}
    console = Console(width=columns, record=True, color_system=None,
                      file=io.StringIO())
    console.print(render(snap, "http://127.0.0.1:9464", columns))
    text = console.export_text()
    rows = [_cells(line) for line in text.splitlines()]
    assert all(len(line) <= columns for line in text.splitlines()), text
    assert "…" not in text, text
    assert [f"lanes of {name}"] in rows, text
    values = list(wide.values())
    if columns == 80:
        assert list(LANE_COLUMNS) in rows and ["low_latency", *values] in rows, text
        assert [name, "88.8%", "99.9%", "12.5 lvl", "alive"] in rows, text
    else:
        assert list(LANE_COLUMNS[:4]) in rows and ["low_latency", *values[:3]] in rows, text
        assert ["lane", *LANE_COLUMNS[4:]] in rows and ["low_latency", *values[3:]] in rows
        (i,) = [i for i, r in enumerate(rows) if r[1:] == ["88.8%", "99.9%", "12.5 lvl",
                                                          "alive"]]
        assert rows[i][0] + rows[i + 1][0] == name, text  # wrapped in its table, whole
    assert ["engine", "KV hit", "KV used", "skeleton p50", "state"] in rows, text


def test_every_figure_of_a_top_screen_is_asked_at_the_same_cycle(monkeypatch):
    """The status's as_of pins every query of the snapshot (a cycle landing between two
    of its queries cannot mix two cycles on one screen)."""
    from ac_observe.daemon.cli import top as cli_top
    asked = []

    def get_json(obj, path, expect, **params):
        asked.append((path, params))
        if path == "/api/v1/status":
            return {"as_of": 1_800_000_123.25, "collectors": [], "engines": []}
        if path == "/api/v1/alerts":
            return {"alerts": [], "rules": 0}
        return {"unit": "ns", "series": [], "as_of": float(params["at"])}

    monkeypatch.setattr(cli_top, "get_json", get_json)
    snap = cli_top.snapshot({"url": "http://x", "token": None}, "5m")
    queries = [params for path, params in asked if path == "/api/v1/query"]
    assert asked[0][0] == "/api/v1/status" and len(queries) == len(cli_top.FIGURES)
    assert all(q["at"] == repr(1_800_000_123.25) and q["window"] == "5m" for q in queries)
    assert snap["as_of"] == 1_800_000_123.25


def test_top_lists_the_alerts_pending_or_firing_in_their_metrics_units():
    from rich.console import Console

    from ac_observe.daemon.cli.top import _alerts
    body = {"rules": 3, "alerts": [
        {"rule": "TtftDrift", "state": "firing", "no_data": False, "value": 12_300_000.0,
         "baseline": 8_000_000.0, "metric": "inference_latency_ns", "statistic": "p95",
         "labels": {"engine": "e1", "model": "tiny", "stream": "low_latency"}},
        {"rule": "[bold]KvHit", "state": "pending", "no_data": True, "value": None,
         "baseline": 91.5, "metric": "kv_cache_hit_rate", "statistic": "mean",
         "labels": {"engine": "e2"}},
        {"rule": "FastShare", "state": "firing", "no_data": False, "value": 71.5,
         "baseline": 95.0, "metric": "inference_latency_ns", "statistic": "share_below:200ms",
         "labels": {"engine": "e3"}}]}
    console = Console(width=80, record=True, color_system=None)
    console.print(_alerts(body))
    text = console.export_text()
    rows = [_cells(line) for line in text.splitlines()]
    (first,) = [i for i, r in enumerate(rows) if r == ["TtftDrift", "firing", "12.3 ms",
                                                      "8.00 ms"]]
    # The label set under its rule, whole (the model is the engine's).
    assert rows[first + 1] == ["engine=e1 stream=low_latency"], text
    kv = rows.index(["[bold]KvHit", "pending", "-", "91.5%"])
    assert rows[kv + 1] == ["engine=e2", "(no data)"], text
    share = rows.index(["FastShare", "firing", "71.5%", "95.0%"])  # a share, in %
    assert rows[share + 1] == ["engine=e3"], text
    for body, line in (({"rules": 0, "alerts": []}, "no rules"),
                       ({"rules": 2, "alerts": []}, "none pending or firing (2 rules)")):
        console = Console(width=80, record=True, color_system=None)
        console.print(_alerts(body))
        assert line in console.export_text()


@pytest.mark.stack
def test_top_says_in_one_line_when_the_daemon_goes_away(start_daemon, tmp_path):
    daemon = start_daemon(None, "--collectors", "engine")
    out_file = tmp_path / "out"
    tmux = Tmux(f"{AC_OBSERVE} --daemon {daemon.url} top 2> {out_file}; echo $? >> {out_file}",
                80, 30)
    try:
        wait_for(lambda: "lanes" in tmux.screen(), 30, "top's screen")
        daemon.stop()
        # Exit code 3: the daemon cannot be reached.
        wait_for(lambda: out_file.exists() and out_file.read_text().strip().endswith("3"), 15,
                 "top to exit")
    finally:
        tmux.close()
    lines = out_file.read_text().strip().splitlines()
    assert len(lines) == 2 and "cannot reach the ac-observe daemon" in lines[0], lines
    assert "Traceback" not in out_file.read_text()


@pytest.mark.parametrize("columns", [80, 160])
def test_the_list_shows_every_friendly_name_whole(columns):
    """The names are what a user types after --metric: none is cut at any width, and the
    Prometheus family each comes from is listed where there is room."""
    from ac_observe.daemon.query import describe_friendly
    out = run_cli("--daemon", f"http://127.0.0.1:{free_port()}", "--list",
                  env={**os.environ, "COLUMNS": str(columns)})
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout, out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= columns
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    for entry in describe_friendly():
        assert entry["name"] in listed, (entry["name"], out.stdout)
        assert (entry["source"] in out.stdout) == (columns >= 120), (entry, out.stdout)


def test_the_alerts_command_keeps_rules_and_labels_whole_in_their_units(monkeypatch, capsys):
    """At 80 columns two alerts of one rule on two lanes are told apart (rule names and
    label sets whole, never '…'), and values read in the metric's unit, not 2.296e+08."""
    from ac_observe.daemon.cli import alerts as cli_alerts
    drift = {"rule": "InferenceLatencyDrift", "severity": "warning", "no_data": False,
             "metric": "inference_latency_ns", "statistic": "p95", "value": 229_600_000.0,
             "baseline": 180_000_000.0, "active_since": 1.7e9, "firing_since": 1.7e9 + 120}
    body = {"rules": 2, "alerts": [
        {**drift, "state": "firing", "labels": {"engine": "engine-8000", "model": "tiny",
                                                "stream": "low_latency"}},
        {**drift, "state": "pending", "labels": {"engine": "engine-8000", "model": "tiny",
                                                 "stream": "throughput"}}],
        "history": [{"rule": "KvCacheHitRateDrop", "at": 1.7e9, "from_state": "pending",
                     "to_state": "firing", "value": 71.25, "baseline": 93.0,
                     "metric": "kv_cache_hit_rate", "statistic": "mean",
                     "labels": {"engine": "engine-8000"}}]}
    monkeypatch.setattr(cli_alerts, "get_json", lambda obj, path, expect, **params: body)
    monkeypatch.setenv("COLUMNS", "80")
    assert cli_alerts.show_alerts({"url": "http://127.0.0.1:9410"}, True, False) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(map(len, out.splitlines())) <= 80, out
    flat = " ".join(out.split())
    for whole in ("InferenceLatencyDrift", "KvCacheHitRateDrop", "stream=low_latency",
                  "stream=throughput", "pending → firing"):
        assert whole in out, (whole, out)
    rows = [_cells(line) for line in out.splitlines()]
    assert any(r[:2] == ["InferenceLatencyDrift", "firing"] and "230 ms" in r
               and "180 ms" in r for r in rows), out
    assert "71.2%" in flat and "93.0%" in flat, out
    # A long label, "(no data)", and narrower: figures are never cut, whatever folds.
    body["alerts"][1].update(no_data=True, labels={"model": "Meta-Llama-3.1-8B-Instruct"})
    for columns in ("80", "60"):
        monkeypatch.setenv("COLUMNS", columns)
        assert cli_alerts.show_alerts({"url": "http://127.0.0.1:9410"}, False, False) == 0
        out = capsys.readouterr().out
        assert "…" not in out and max(map(len, out.splitlines())) <= int(columns), out
        figures = [r for r in (_cells(line) for line in out.splitlines())
                   if "230 ms" in r]
        assert len(figures) == 2 and all("180 ms" in r for r in figures), out


def test_the_alerts_command_says_which_series_wait_for_a_baseline(monkeypatch, capsys):
    """A rule whose baseline is still building is listed with why, labels as they are
    (an engine name is not rich markup), ten series at most and how many more."""
    from ac_observe.daemon.cli import alerts as cli_alerts
    why = ("no baseline: trailing 60 s before the window: still building (25 % of it "
           "watched, 50 % needed)")
    body = {"rules": 1, "alerts": [], "history": [], "waiting": [
        {"rule": "DemoLatencyDrift", "labels": {"engine": f"[red]e{i}", "stream": "x"},
         "value": 1.0, "waiting_for": why} for i in range(12)]}
    monkeypatch.setattr(cli_alerts, "get_json", lambda obj, path, expect, **params: body)
    monkeypatch.setenv("COLUMNS", "200")
    assert cli_alerts.show_alerts({"url": "http://127.0.0.1:9410"}, False, False) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "no alert pending or firing"
    assert lines[1:] == [f"DemoLatencyDrift {{engine=[red]e{i},stream=x}} waits: {why}"
                         for i in range(10)] + [
        "and 2 more series waiting (ac-observe alerts --json)"]


def test_every_help_names_every_option_whole_at_80_columns():
    """Option and environment variable names are what a user copies from --help: whole
    at 80 columns, in every command (rich's panels cut them to '--gpu-memory-utiliz…')."""
    import typer
    from typer.testing import CliRunner

    from ac_observe.daemon.cli import app
    root = typer.main.get_command(app)

    def commands(command, path=()):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from commands(sub, path + (name,))

    seen = 0
    for path, command in commands(root):
        out = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"},
                                 terminal_width=80)
        assert out.exit_code == 0, (path, out.output)
        assert "…" not in out.output and max(map(len, out.output.splitlines())) <= 80, \
            (path, out.output)
        # Nor split at a hyphen inside a description (--kv-memory-⏎mb).
        assert not [line for line in out.output.splitlines() if re.search(r"\w-$", line)], \
            (path, out.output)
        for param in command.params:
            if param.param_type_name == "option":
                for name in [*param.opts, *param.secondary_opts]:
                    assert name in out.output, (path, name, out.output)
                    seen += 1
                if param.envvar and param.show_envvar:
                    assert param.envvar in out.output, (path, param.envvar, out.output)
    assert seen > 60  # the commands' options were found and looked at


def test_status_keeps_engine_names_and_addresses_whole_at_80_columns(monkeypatch, capsys):
    """Names, models (an HF folder's name is long) and API addresses are what a user types
    next: whole at 80 columns, each engine's under its name, beside its state."""
    from ac_observe.daemon.cli import status as cli_status
    reason = "NVML library libnvidia-ml.so.1 not found (no NVIDIA driver on this host)"
    body = {"version": "0.1.0", "interval_seconds": 1, "window_seconds": 3600,
            "telemetry_root": "/tmp/ac-observe-0/telemetry",
            "collectors": [{"name": "engine", "up": True, "reason": "", "errors_total": 0,
                            "duration_seconds": 0.0006},
                           {"name": "nvml", "up": False, "reason": reason,
                            "errors_total": 3, "duration_seconds": 0.0003}],
            "engines": [{"engine": "engine-8000", "model": "Meta-Llama-3.1-8B-Instruct",
                         "pid": 19003, "api_address": "http://127.0.0.1:8000", "alive": True,
                         "heartbeat_age_seconds": 0.8, "restarts": 2},
                        {"engine": "engine-8001", "model": "tiny", "pid": 7,
                         "api_address": "http://10.0.0.12:8001", "alive": False,
                         "heartbeat_age_seconds": 120.0, "restarts": 0},
                        {"engine": "bad-one", "model": "?", "pid": "?", "api_address": "",
                         "error": "engine.json: not JSON", "directory": "/t/bad-one"}]}
    monkeypatch.setattr(cli_status, "get_json", lambda *args, **kwargs: body)
    monkeypatch.setenv("COLUMNS", "80")
    assert cli_status.show_status({"url": "http://127.0.0.1:9410"}, False) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(map(len, out.splitlines())) <= 80, out
    rows = [_cells(line) for line in out.splitlines()]
    first = rows.index(["engine-8000", "19003", "alive, 2 restarts", "0.8s ago"])
    assert rows[first + 1:first + 3] == [["Meta-Llama-3.1-8B-Instruct"],
                                         ["http://127.0.0.1:8000"]], out
    second = rows.index(["engine-8001", "7", "gone", "120.0s ago"])
    assert rows[second + 1:second + 3] == [["tiny"], ["http://10.0.0.12:8001"]], out
    for word in reason.split() + ["engine.json:", "not", "JSON"]:
        assert word in out, (word, out)
