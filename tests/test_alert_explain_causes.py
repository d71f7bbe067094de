"""Each cause of `ac-observe up --demo-drift-cause` fires a TTFT drift rule on a real
engine, and the alert's explanation (daemon/alerting/explain.py) ranks the part and the
cause that the drift moved first, and leaves little unexplained.

A real engine with `--fault-injection` serves the demo traffic (daemon/demo_load.py, sent
from this process in the shape the driver changes); an in-process daemon reads its
telemetry files into its real windows every second and evaluates a real rule from an
alerting file (TTFT p95 of the throughput lane, RULE_WINDOW against the trailing
BASELINE_SECONDS before it, RULE_THRESHOLD up for RULE_FOR), as `ac-observe up
--demo-drift`'s rule does with longer spans. The drift is applied by the same driver as
`up --demo-drift` (daemon/demo_drift.py `DriftDriver.drift`). Each test waits for the
rule to fire and reads the firing alert's explanation as `GET /api/v1/alerts?explain=1`
answers it (`Evaluator.explained`) once its window lies wholly in the drift and holds
MIN_REQUESTS; that one reading is judged. Ranking and ratios only: absolute times on a
shared 2-core machine are anyone's guess.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from ac_observe.auth import FAULT_TOKEN_ENV
from ac_observe.daemon.alerting.explain import NOTABLE_RATIO, RELATED, Reader, Span
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.demo_drift import DEMO_CLIENTS, LOAD_BATCH_LIMIT, DriftDriver
from ac_observe.daemon.demo_load import LoadShape, run_demo_load
from ac_observe.daemon.service import Daemon
from support.servers import EngineServer

pytestmark = pytest.mark.slow

FAULT_TOKEN = "explain-causes-fault-token"
ENGINE = "e1"
RULE = "CauseDrift"
LANE = "throughput"  # the demo traffic's busier lane (70 %)
BASELINE_SECONDS = 15.0
RULE_WINDOW_SECONDS = 15.0
RULE_THRESHOLD = 0.5  # p95 +50 %: above a calm engine's swings between 15 s windows
RULE_FOR_SECONDS = 2.0
RECOVERY_SECONDS = 5.0  # after a drift ends, before the next baseline span begins
MIN_REQUESTS = 8  # TTFT observations in each span
DRIFT_DEADLINE_SECONDS = 60.0  # the longest a drift runs: the rule fires, its window fills
SETTLE_SECONDS = 3.0  # after the drift began, before the window read may start
RESIDUAL_SHARE = 0.2
WARMUP_SECONDS = 15.0


# A part of the explanation, from one request's own trace (x-ac-trace-detail, ac_trace):
# its figure in ms, and when the engine observed it, in seconds after the request left.
# The prefill phase is the TTFT less front-end and queue (the trace's `prefill_ms` is the
# prefill step's device time, which a slowed engine's sleep is not).
TRACE_PARTS = {
    "front-end": (lambda t: t["frontend_ms"], lambda t: t["frontend_ms"] / 1e3),
    "queue": (lambda t: t["queue_time_ns"] / 1e6,
              lambda t: t["frontend_ms"] / 1e3 + t["queue_time_ns"] / 1e9),
    "prefill": (lambda t: (t["model_latency_ns"] - t["queue_time_ns"]) / 1e6
                - t["frontend_ms"], lambda t: t["model_latency_ns"] / 1e9),
}
TRACE_AGREEMENT = 0.10
# A request observed this close to a span's first or last cycle may be on either side of
# it: the client's clock against the engine's, the engine's telemetry flushed after a step.
EDGE_SECONDS = 0.25


@dataclass
class Live:
    engine: EngineServer
    daemon: Daemon
    shape: LoadShape
    as_of: float = 0.0  # the newest cycle's time
    calm_since: float = field(default_factory=time.time)
    cycles: list[float] = field(default_factory=list)  # every cycle's time
    traces: list[dict] = field(default_factory=list)  # every answer's, as the client got it
    in_flight: dict[int, float] = field(default_factory=dict)  # client -> when it sent


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("causes")
    (root / "telemetry").mkdir()
    # A batch limit of 4 a lane: a burst waits in the queue, as on a server at its limit,
    # rather than growing the batch until every step is many times slower (on 2 CPU
    # cores the steps then slow more than the load grew, and closed-loop clients arrive
    # hardly faster than before).
    engine = EngineServer(root / "telemetry" / ENGINE, "--engine-name", ENGINE,
                          "--fault-injection", "--throughput-seqs", str(LOAD_BATCH_LIMIT),
                          env={**os.environ, FAULT_TOKEN_ENV: FAULT_TOKEN}).wait_ready()
    alerting = root / "alerting.yaml"
    alerting.write_text(
        f"rules:\n  - {{name: {RULE}, metric: inference_latency_ns, statistic: p95, "
        f"window: {RULE_WINDOW_SECONDS:g}s, baseline: 'trailing:{BASELINE_SECONDS:g}s', "
        f"comparison: relative_increase, threshold: {RULE_THRESHOLD}, "
        f"for: {RULE_FOR_SECONDS:g}s, match: {{engine: {ENGINE}, stream: {LANE}}}}}\n")
    daemon = Daemon(DaemonConfig(telemetry_root=root / "telemetry", collectors=("engine",),
                                 interval_seconds=1.0, window_seconds=600,
                                 state_dir=root / "state", alerting_file=alerting,
                                 alert_interval_seconds=1.0))
    assert daemon.alerts is not None and RULE in daemon.alerts.rules
    stop = threading.Event()
    state = Live(engine, daemon, LoadShape(clients=DEMO_CLIENTS))

    def cycles() -> None:
        while not stop.is_set():
            now = time.time()
            daemon.run_cycle(now=now)
            state.cycles.append(now)
            state.as_of = now
            stop.wait(max(0.0, now + 1.0 - time.time()))

    threads = [threading.Thread(target=cycles, daemon=True),
               threading.Thread(target=run_demo_load, args=(engine.url, stop),
                                kwargs={"shape": state.shape, "on_trace": state.traces.append,
                                       "in_flight": state.in_flight}, daemon=True)]
    for thread in threads:
        thread.start()
    # A fresh engine's first requests are slower (first runs, caches filling): the first
    # baseline span begins after them.
    state.calm_since = time.time() + WARMUP_SECONDS
    try:
        yield state
    finally:
        stop.set()
        engine.stop()  # the demo clients' requests in flight end with it
        for thread in threads:
            thread.join(timeout=30)
        daemon.close()


def _explained_drift(live: Live, cause: str, checks) -> tuple[dict, list[str]]:
    """Drift by `cause` after a calm baseline until the rule fires; the firing alert's
    explanation is read once, the first time its window lies wholly in the drift (from
    SETTLE_SECONDS after it began) and holds MIN_REQUESTS, whatever it says; `checks` (a
    list of what failed: [] passes) and the traces' agreement judge that one reading."""
    driver = DriftDriver(live.engine.url, "", 0, 0, fault_token=FAULT_TOKEN, cause=cause,
                         shape=live.shape)
    with httpx.Client(timeout=10) as client:
        began = _calm_baseline(live)
        assert driver.drift(client, True)
        found = None
        try:
            deadline = began + DRIFT_DEADLINE_SECONDS
            while found is None and time.time() < deadline:
                alert = _firing(live)
                explained = alert and alert["explanation"]
                if explained and explained["window"]["start"] >= began + SETTLE_SECONDS \
                        and explained["mean"]["observations"] >= MIN_REQUESTS:
                    found = explained
                time.sleep(1.0)
        finally:  # an assert here would hide the exception that brought it here
            stopped = driver.drift(client, False)
            drained = _drained(live)
    assert stopped, "the drift could not be stopped"
    # (else the next test's calm baseline would hold this backlog)
    assert drained, "the drift's backlog did not leave the engine in 90 s"
    if found is None:
        return {}, [f"{RULE} did not fire with a window of {MIN_REQUESTS} drifted requests"]
    _answered(live, found["window"]["end"])
    return found, checks(found) + _trace_disagreements(live, found)


def _answered(live: Live, until: float) -> None:
    """Until every request sent by `until` has answered (its trace comes with its last
    event), 60 s at most."""
    deadline = time.time() + 60
    while time.time() < deadline and any(sent <= until for sent in
                                         list(live.in_flight.values())):
        time.sleep(0.2)


def _trace_disagreements(live: Live, found: dict) -> list[str]:
    """Each part's mean over the window and over the baseline span against the mean of the
    same requests' own trace figures: within TRACE_AGREEMENT. The same requests: those the
    engine observed between the span's first and last daemon cycles (a span's increase is
    read between the two); one within EDGE_SECONDS of either may count or not, so the
    traces' mean is a range: the lowest and highest it takes over those."""
    out = []
    for span, figure_key in (("window", "now_ms"), ("baseline_span", "baseline_ms")):
        inside = [c for c in live.cycles
                  if found[span]["start"] <= c <= found[span]["end"] + 1e-6]
        low, high = inside[0], inside[-1]
        for part in found["parts"]:
            if part["name"] not in TRACE_PARTS:
                continue
            figure, at = TRACE_PARTS[part["name"]]
            sure, edge = [], []
            for t in list(live.traces):
                if t.get("stream") != LANE:
                    continue
                when = t["sent"] + at(t)
                if low + EDGE_SECONDS < when <= high - EDGE_SECONDS:
                    sure.append(figure(t))
                elif low - EDGE_SECONDS < when <= high + EDGE_SECONDS:
                    edge.append(figure(t))
            said = part[figure_key]
            if not sure or said is None:
                out.append(f"{part['name']} over the {span}: {said} ms, {len(sure)} traces")
                continue
            lowest, highest = _mean_range(sure, edge)
            if not lowest * (1 - TRACE_AGREEMENT) <= said <= highest * (1 + TRACE_AGREEMENT):
                out.append(f"{part['name']} over the {span}: {said:.4g} ms, the traces' "
                           f"{lowest:.4g}..{highest:.4g} ms ({len(sure)} requests, "
                           f"{len(edge)} at the edges)")
    return out


def _mean_range(sure: list[float], maybe: list[float]) -> tuple[float, float]:
    """The lowest and the highest mean of `sure` with any of `maybe` added: the lowest
    takes those below it, smallest first, while they lower it; the highest alike."""
    def extreme(ordered: list[float], lower: bool) -> float:
        total, count = sum(sure), len(sure)
        for value in ordered:
            if not (value < total / count if lower else value > total / count):
                break
            total, count = total + value, count + 1
        return total / count
    return extreme(sorted(maybe), True), extreme(sorted(maybe, reverse=True), False)


def _alerts(live: Live) -> list[dict]:
    assert live.daemon.alerts is not None
    return [a for a in live.daemon.alerts.explained() if a["rule"] == RULE]


def _firing(live: Live) -> dict | None:
    """The rule's firing alert with its explanation, as `?explain=1` answers it."""
    firing = [a for a in _alerts(live) if a["state"] == "firing"]
    assert len(firing) <= 1, firing  # one engine, one lane
    return firing[0] if firing else None


def _drained(live: Live) -> bool:
    """Once the drift's backlog has left the engine (a burst's waiting requests): the
    calm begins then. False if it did not leave within 90 s."""
    reader = Reader(live.daemon, {"engine": ENGINE, "stream": LANE})
    deadline = time.time() + 90
    while time.time() < deadline:
        now = live.as_of
        waiting = reader.value("requests_waiting", Span(now - 3, now), "sum")
        if waiting is not None and waiting < 1:
            live.calm_since = time.time()
            return True
        time.sleep(0.5)
    live.calm_since = time.time()
    return False


def _calm_baseline(live: Live) -> float:
    """When the calm spans end: a baseline's and a window's worth watched after
    RECOVERY_SECONDS since the last drift ended, holding MIN_REQUESTS, and the rule quiet
    (the last drift's alert resolved, no calm swing pending)."""
    reader = Reader(live.daemon, {"engine": ENGINE, "stream": LANE})
    deadline = time.time() + 120
    calm = RECOVERY_SECONDS + BASELINE_SECONDS + RULE_WINDOW_SECONDS
    while True:
        began = live.as_of
        if began >= live.calm_since + calm and not _alerts(live):
            _, count = reader.histogram("inference_latency_ns",
                                        Span(began - BASELINE_SECONDS, began))
            if count >= MIN_REQUESTS:
                return began
        assert time.time() < deadline, "no calm baseline span with enough requests"
        time.sleep(0.5)


def _ranked(found: dict) -> list[str]:
    return [p["name"] for p in sorted(found["parts"], key=lambda p: -(p["share"] or 0))]


def _causes(found: dict) -> dict:
    return {c["name"]: c for c in found["causes"]}


def _ratio(cause: dict) -> float:
    b, n = cause["baseline"], cause["now"]
    return n / b if b and n is not None else (float("inf") if n else 0.0)


def _named(found: dict) -> list[str]:
    """The causes the verdict names, in its order ("... (running 8.2x baseline, hit rate
    86 -> 0)" -> running, hit rate)."""
    verdict = found["verdict"]
    if not verdict.endswith(")"):
        return []
    phrases = verdict[verdict.rfind(" (") + 2:-1].split(", ")
    return [max((name for name in _causes(found) if phrase.startswith(name + " ")),
                key=len, default=phrase) for phrase in phrases]


def _common(found: dict, part: str) -> dict[str, bool]:
    parts = {p["name"]: p for p in found["parts"]}
    first = (_named(found) or [""])[0]
    groups = {c["name"]: c["group"] for c in found["causes"]}
    return {
        "the mean rose": (found["mean"]["change_ms"] or 0) > 0,
        f"{part} ranked first": _ranked(found)[0] == part,
        f"{part} over half the change": (parts[part]["share"] or 0) > 0.5,
        "unexplained under 20 %": parts["unexplained"]["share"] is not None
        and abs(parts["unexplained"]["share"]) < RESIDUAL_SHARE,
        "the verdict names the part first": f": {part} time +" in found["verdict"],
        "a cause named, one that moves the part": groups.get(first) in RELATED[part],
    }


def _report(found: dict) -> str:
    if not found:
        return "no explanation read"
    parts = {p["name"]: (p["baseline_ms"], p["now_ms"], p["share"]) for p in found["parts"]}
    return f"{found.get('verdict')}; parts {parts}; causes " + str(
        {c["name"]: (c["baseline"], c["now"]) for c in found.get("causes", [])
         if c["baseline"] is not None or c["now"] is not None})


def _failed(checks: dict[str, bool]) -> list[str]:
    return [name for name, held in checks.items() if not held]


def test_a_burst_of_load_is_explained_by_queue_time_with_arrivals_up(live):
    """More requests arrive than the batch limit takes: they wait. Closed-loop clients
    of a busy engine arrive only somewhat faster (requests/s counts those finished, which
    may fall), so the load shows as waiting requests and arrivals not down."""
    def checks(found):
        causes = _causes(found)
        return _failed({
            **_common(found, "queue"),
            "its first cause is load": causes.get((_named(found) or [""])[0],
                                                  {}).get("group") == "load",
            "waiting at least 3x": _ratio(causes["waiting"]) >= 3.0,
            "arrivals/s not down": _ratio(causes["arrivals/s"]) >= 1.0,
        })

    found, failed = _explained_drift(live, "load", checks)
    assert not failed, f"{failed}: {_report(found)}"
    print(_report(found))  # the figures, for -rP


def test_a_flushed_prefix_cache_is_explained_by_prefill_with_evicted_misses(live):
    def checks(found):
        causes = _causes(found)
        evicted, cold = causes["misses evicted"], causes["misses cold"]
        return _failed({
            **_common(found, "prefill"),
            "its first cause is the KV cache": causes.get((_named(found) or [""])[0],
                                                          {}).get("group") == "kv",
            "misses evicted or cold up 20 points": (evicted["now"] or 0) + (cold["now"] or 0)
            - (evicted["baseline"] or 0) - (cold["baseline"] or 0) >= 20,
            "the hit rate at most half": _ratio(causes["hit rate"]) <= 0.5,
        })

    found, failed = _explained_drift(live, "cache", checks)
    assert not failed, f"{failed}: {_report(found)}"
    print(_report(found))  # the figures, for -rP


def test_long_prompts_are_explained_by_prefill_with_prompt_tokens_up(live):
    def checks(found):
        causes = _causes(found)
        return _failed({
            **_common(found, "prefill"),
            "prompt tokens/request named first": _named(found)[:1] == ["prompt tokens/request"],
            "prompt tokens/request at least 3x": _ratio(causes["prompt tokens/request"]) >= 3,
        })

    found, failed = _explained_drift(live, "prompts", checks)
    assert not failed, f"{failed}: {_report(found)}"
    print(_report(found))  # the figures, for -rP


def test_slower_steps_are_explained_by_prefill_and_queue_with_slower_steps(live,
                                                                           monkeypatch):
    """Every engine step slower (60 ms here, not the demo's 300, so that a window holds
    enough requests): a request's prefill phase takes its slower first step, and it waits
    in the queue behind the slower steps of others; the slower steps show as inter-token
    latency (the engine's own cause); the load did not grow."""
    from ac_observe.daemon import demo_drift
    monkeypatch.setattr(demo_drift, "STEP_DELAY_MS", 60)

    def checks(found):
        parts = {p["name"]: p for p in found["parts"]}
        causes = _causes(found)
        return _failed({
            "the mean rose": (found["mean"]["change_ms"] or 0) > 0,
            "prefill among the first two": "prefill" in _ranked(found)[:2],
            "prefill + queue over 60 %": (parts["prefill"]["share"] or 0)
            + (parts["queue"]["share"] or 0) > 0.6,
            "unexplained under 20 %": parts["unexplained"]["share"] is not None
            and abs(parts["unexplained"]["share"]) < RESIDUAL_SHARE,
            "inter-token at least twice": _ratio(causes["inter-token"]) >= 2.0,
            "arrivals/s not up": _ratio(causes["arrivals/s"]) < NOTABLE_RATIO,
            "its first cause is the engine's": causes.get((_named(found) or [""])[0],
                                                          {}).get("group") == "engine",
        })

    found, failed = _explained_drift(live, "steps", checks)
    assert not failed, f"{failed}: {_report(found)}"
    print(_report(found))  # the figures, for -rP
