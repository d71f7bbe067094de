"""Alert webhooks: the outbox in a real store (SQLite file and a real PostgreSQL server),
delivered to a loopback receiver over HTTP, signed per Standard Webhooks and checked with
the `standardwebhooks` library, retried across a receiver outage and a killed daemon."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from ac_observe.daemon.alerting.alert import fingerprint
from ac_observe.daemon.alerting.file import load_alerting
from ac_observe.daemon.alerting.outbox import Backoff, WebhookSender, retry_after
from ac_observe.daemon.alerting.receivers import Receiver
from ac_observe.daemon.alerting.spec import AlertConfigError
from ac_observe.daemon.store import DELIVERED, DISABLED, FAILED, PENDING
from support.grafana import Grafana
from support.processes import start_process
from support.receivers import SECRET, WebhookReceiver
from support.servers import parse_metrics, wait_for


class _Clock:
    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def receiver():
    r = WebhookReceiver()
    yield r
    r.down()


def _sender(store, receiver, clock, **kwargs):
    return WebhookSender(store, {"ops": Receiver("ops", receiver.url, secret=SECRET,
                                                 timeout_seconds=5)},
                         external_url="http://127.0.0.1:9410", clock=clock, seed=1, **kwargs)


def test_a_test_delivery_is_an_alertmanager_v4_body_signed_per_standard_webhooks(
        store, receiver):
    clock = _Clock()
    sender = _sender(store, receiver, clock)
    (delivery_id,) = sender.send_test(host="node-7")
    assert sender.run_once() == 1
    (headers, body), = receiver.requests
    assert headers["webhook-id"] == delivery_id
    payload = Webhook(SECRET).verify(body, headers)  # raises unless the signature holds
    assert payload["version"] == "4" and payload["status"] == "firing"
    assert payload["receiver"] == "ops"
    assert payload["groupKey"] == \
        '{}:{alertname="AcObserveTestAlert", instance="node-7", severity="none"}'
    (alert,) = payload["alerts"]
    assert alert["labels"] == {"alertname": "AcObserveTestAlert", "severity": "none",
                               "instance": "node-7"}
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["fingerprint"] == fingerprint(alert["labels"])
    assert payload["commonLabels"] == alert["labels"]
    assert store.delivery(delivery_id)["state"] == DELIVERED
    assert sender.outcomes["ops", "delivered"] == 1
    with pytest.raises(WebhookVerificationError):  # another secret does not verify it
        Webhook("whsec_" + "A" * 40).verify(body, headers)


def test_fingerprint_separates_names_from_values():
    # The empty set's is FNV-1a 64's offset basis; the separator keeps "a"+"bc" apart from
    # "ab"+"c". (That it is Alertmanager's own is checked against the real one below.)
    assert fingerprint({}) == "cbf29ce484222325"
    assert fingerprint({"a": "bc"}) != fingerprint({"ab": "c"})
    assert fingerprint({"a": "b", "c": "d"}) != fingerprint({"a": "bc", "": "d"})


def test_receiver_down_then_failing_then_back_gets_it_once_under_one_id(store, receiver):
    clock = _Clock()
    start = clock.now
    sender = _sender(store, receiver, clock)
    (delivery_id,) = sender.send_test(host="n")
    receiver.down()  # refusing for 30 s, then 500s until 60 s, then back
    modes = []
    while store.delivery(delivery_id)["state"] == PENDING:
        clock.now = max(clock.now, store.delivery(delivery_id)["next_attempt_at"])
        elapsed = clock.now - start
        if 30 <= elapsed and receiver.mode == "ok" and not modes.count("500"):
            receiver.up()
            receiver.mode = "500"
        if elapsed >= 60:
            receiver.mode = "ok"
        modes.append("refused" if elapsed < 30 else receiver.mode)
        sender.run_once()
        assert len(modes) < 40
    row = store.delivery(delivery_id)
    assert row["state"] == DELIVERED
    assert "refused" in modes and "500" in modes and modes[-1] == "ok"
    attempts = store.attempts_of(delivery_id)
    assert len(attempts) == len(modes) == row["attempts"]
    assert [a["status"] for a in attempts if a["status"]] == \
        [500] * modes.count("500") + [200]
    # Every request that reached the receiver carried the one id; one was answered 2xx.
    assert {h["webhook-id"] for h, _ in receiver.requests} == {delivery_id}
    assert len(receiver.requests) == modes.count("500") + 1
    # Backoff doubled with jitter: each wait between half and all of 1, 2, 4, ... s.
    waits = [b["at"] - a["at"] for a, b in zip(attempts, attempts[1:], strict=False)]
    for n, wait in enumerate(waits, start=1):
        full = min(300.0, 2.0 ** (n - 1))
        assert 0.5 * full <= wait <= full + 1e-6, (n, wait)
    for headers, body in receiver.requests:
        Webhook(SECRET).verify(body, headers)  # re-signed per attempt: still valid


def test_retry_after_is_honoured_and_410_disables_the_receiver(store, receiver):
    clock = _Clock()
    sender = _sender(store, receiver, clock)
    (first,) = sender.send_test(host="n")
    receiver.mode, receiver.retry_after = "429", "120"
    sender.run_once()
    assert store.delivery(first)["next_attempt_at"] == pytest.approx(clock.now + 120)
    clock.now += 60
    assert sender.run_once() == 0  # not due yet
    clock.now += 61
    receiver.mode, receiver.retry_after = "410", None
    (second,) = sender.send_test(host="n")
    sender.run_once()
    assert store.delivery(first)["state"] == DISABLED
    assert store.delivery(second)["state"] == DISABLED
    assert store.disabled() == {"ops": receiver.url}
    (third,) = sender.send_test(host="n")
    requests = len(receiver.requests)
    clock.now += 3600
    assert sender.run_once() == 0 and len(receiver.requests) == requests
    # A new URL in the file (the receiver moved) turns it back on.
    receiver.mode = "ok"
    moved = WebhookSender(store, {"ops": Receiver("ops", receiver.url + "?v=2",
                                                  secret=SECRET)}, clock=clock)
    assert store.disabled() == {}
    assert moved.run_once() == 1 and store.delivery(third)["state"] == DELIVERED


def test_a_delivery_older_than_max_age_fails_for_good(store, receiver):
    clock = _Clock()
    sender = _sender(store, receiver, clock, backoff=Backoff(max_age=600))
    (delivery_id,) = sender.send_test(host="n")
    receiver.mode = "500"
    sender.run_once()
    clock.now += 601
    sender.run_once()
    assert store.delivery(delivery_id)["state"] == FAILED
    assert sender.outcomes["ops", "failed"] == 1


def test_a_claim_takes_one_delivery_and_leaves_the_others_due(store):
    """Three due at once: each claim takes exactly one (on PostgreSQL an `UPDATE ... IN
    (SELECT ... LIMIT 1 FOR UPDATE SKIP LOCKED)` claimed several and attempted one)."""
    now = time.time()
    ids = {store.add("ops", "firing", {"n": i}, now) for i in range(3)}
    claimed = [store.claim_one(now, ["ops"], 60.0) for _ in range(4)]
    assert claimed[3] is None
    assert {d.id for d in claimed[:3]} == ids
    assert all(store.delivery(i)["next_attempt_at"] == now + 60.0 for i in ids)


def test_a_receiver_that_hangs_delays_only_its_own_deliveries(store):
    """Two alerts to a receiver that hangs and to one that answers at once: the quick one
    has both while the slow one still holds its first (one pass over every receiver in
    turn had the quick one wait behind each of the slow one's answers)."""
    slow, quick = WebhookReceiver(), WebhookReceiver()
    slow.mode, slow.hang_seconds = "hang", 8.0  # under the sender's 10 s timeout
    sender = WebhookSender(store, {
        "slow": Receiver("slow", slow.url, secret=SECRET, timeout_seconds=10),
        "quick": Receiver("quick", quick.url, secret=SECRET, timeout_seconds=10)}, seed=1)
    sender.start()
    try:
        for status in ("firing", "resolved"):
            sender.enqueue([_transition(status, time.time() - 60,
                                        time.time() if status == "resolved" else None)],
                           status)
        wait_for(lambda: len(quick.requests) == 2, 7, "both at the quick receiver")
        # ... while the slow one is still held with its first (in turn: 8 s behind it)
        assert len(slow.requests) <= 1 and sender.outcomes["slow", "delivered"] == 0
        slow.release.set()
        wait_for(lambda: sender.outcomes["slow", "delivered"] == 2, 15, "the slow receiver")
        assert sender.outcomes["quick", "delivered"] == 2
    finally:
        sender.stop()
        slow.down()
        quick.down()


@pytest.mark.slow
def test_a_receiver_slower_than_its_retry_after_is_posted_to_on_time(store):
    """500 after 4 s with `Retry-After: 1`: the next post comes about 1 s after the answer
    (the wait was counted from the post, so it was due before it was recorded: the same
    pass claimed it again, pushing it a lease of 60 + 4 x 10 s ahead, and skipped it)."""
    slow = WebhookReceiver()
    slow.mode, slow.retry_after, slow.answer_after = "500", "1", 4.0
    sender = WebhookSender(store, {"slow": Receiver("slow", slow.url, secret=SECRET,
                                                    timeout_seconds=10)}, seed=1)
    sender.start()
    try:
        sender.send_test(host="n")
        wait_for(lambda: len(slow.received) >= 2, 20, "a second post")
        waited = slow.received[1] - slow.answered[0]
        assert 0.9 <= waited < 10.0, waited  # the receiver's wait kept, and no more
    finally:
        sender.stop()
        slow.down()


def _grafana_sender(store, grafana, clock):
    return WebhookSender(store, {"grafana": Receiver("grafana", grafana.url + "/", "grafana",
                                                     token="glsa_t", timeout_seconds=2)},
                         clock=clock, seed=1)


def _transition(status: str, starts_at: float, ends_at: float | None = None):
    from ac_observe.daemon.alerting.alert import Alert
    return Alert(labels={"alertname": "TtftDrift", "severity": "warning", "engine": "e1"},
                 annotations={"summary": "TTFT p99 0.9 s", "description": "baseline 0.3 s"},
                 status=status, starts_at=starts_at, ends_at=ends_at)


def test_alert_transitions_become_grafana_annotations(store):
    """Firing is a point at the alert's start, resolving a region from start to end, both
    tagged so the dashboards' `ac-observe` annotation query finds them, posted with the
    token to Grafana's annotations API."""
    grafana, clock = Grafana("glsa_t"), _Clock()
    try:
        sender = _grafana_sender(store, grafana, clock)
        start = 1_764_000_000.25
        sender.enqueue([_transition("firing", start)], "firing")
        sender.enqueue([_transition("resolved", start, start + 90.5)], "resolved")
        assert sender.run_once() == 2
        point, region = grafana.annotations
        tags = {"ac-observe", "alertname:TtftDrift", "severity:warning", "engine:e1",
                "fingerprint:" + fingerprint({"alertname": "TtftDrift", "severity": "warning",
                                              "engine": "e1"})}
        assert (point["time"], point["timeEnd"]) == (1_764_000_000_250, 1_764_000_000_250)
        assert set(point["tags"]) == tags | {"firing"}
        assert point["text"] == "FIRING: TTFT p99 0.9 s\nbaseline 0.3 s"
        assert (region["time"], region["timeEnd"]) == (1_764_000_000_250, 1_764_000_090_750)
        assert set(region["tags"]) == tags | {"resolved"}
        # Each is looked for first (an unanswered earlier attempt may have landed), then
        # posted.
        assert [(m, p.split("?")[0]) for m, p, _ in grafana.requests] == \
            [("GET", "/api/annotations"), ("POST", "/api/annotations")] * 2
        assert all(h["authorization"] == "Bearer glsa_t" for _, _, h in grafana.requests)
        # What a board's "ac-observe alerts" query (tags: [ac-observe]) shows in the hour.
        assert grafana.find({"tags": ["ac-observe"], "from": ["1763999000000"],
                             "to": ["1764003000000"]}) == [point, region]
        assert sender.outcomes["grafana", "delivered"] == 2
    finally:
        grafana.close()


@pytest.mark.parametrize("first", ["lost", "500"])
def test_a_retried_annotation_is_never_posted_twice(store, first):
    """An attempt whose answer never came may have landed: the retry finds it and stops;
    one that Grafana refused is posted again. Either way Grafana holds exactly one."""
    grafana, clock = Grafana("glsa_t"), _Clock()
    try:
        sender = _grafana_sender(store, grafana, clock)
        (delivery_id,) = sender.enqueue([_transition("firing", clock.now)], "firing")
        grafana.mode = first
        sender.run_once()
        assert store.delivery(delivery_id)["state"] == PENDING
        assert len(grafana.annotations) == (1 if first == "lost" else 0)
        grafana.mode = "ok"
        clock.now = store.delivery(delivery_id)["next_attempt_at"]
        assert sender.run_once() == 1
        assert store.delivery(delivery_id)["state"] == DELIVERED
        assert len(grafana.annotations) == 1
        methods = [m for m, _, _ in grafana.requests]
        assert methods == (["GET", "POST", "GET"] if first == "lost"
                           else ["GET", "POST", "GET", "POST"])
    finally:
        grafana.close()


def test_an_annotation_from_a_daemon_killed_mid_post_is_found_not_posted_again(store):
    """A daemon killed after its POST landed records no attempt: the delivery is due again
    after the lease with no attempt counted, and still is not posted twice."""
    grafana, clock = Grafana("glsa_t"), _Clock()
    try:
        (delivery_id,) = _grafana_sender(store, grafana, clock).enqueue(
            [_transition("firing", clock.now)], "firing")
        claimed = store.claim_one(clock.now, ["grafana"], 60.0)  # the dead sender's claim
        httpx_post = __import__("httpx").post
        httpx_post(grafana.url + "/api/annotations", content=claimed.body,
                   headers={"authorization": "Bearer glsa_t",
                            "content-type": "application/json"})  # ... and its POST
        clock.now += 61
        assert _grafana_sender(store, grafana, clock).run_once() == 1
        assert store.delivery(delivery_id)["state"] == DELIVERED
        assert len(grafana.annotations) == 1
    finally:
        grafana.close()


@pytest.mark.parametrize("status, state", [(404, FAILED), (400, FAILED), (401, PENDING),
                                           (500, PENDING)])
def test_a_grafana_that_refuses_the_request_itself_is_not_retried(store, status, state):
    """A wrong base URL (404) or a body Grafana will never take (400) fails at once; a bad
    token (401) or a Grafana in trouble (500) is retried."""
    grafana, clock = Grafana("glsa_t"), _Clock()
    try:
        grafana.mode = str(status)
        sender = _grafana_sender(store, grafana, clock)
        (delivery_id,) = sender.enqueue([_transition("firing", clock.now)], "firing")
        sender.run_once()
        assert store.delivery(delivery_id)["state"] == state
    finally:
        grafana.close()


def test_long_label_values_become_tags_grafana_keeps():
    from ac_observe.daemon.alerting.alert import Alert
    from ac_observe.daemon.alerting.notify.grafana import grafana_annotation
    long = "/models/" + "x" * 300
    tags = grafana_annotation([Alert({"alertname": "A", "model": long}, {}, "firing",
                                     1.0)])["tags"]
    (model,) = [t for t in tags if t.startswith("model:")]
    assert len(model.split(":", 1)[1]) <= 100 and model.startswith("model:/models/xxx")
    other = grafana_annotation([Alert({"alertname": "A", "model": long + "y"}, {}, "firing",
                                      1.0)])["tags"]
    assert model not in other  # cut values still tell series apart


def test_retry_after_forms():
    assert retry_after("30", 1000.0) == 30.0
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 1445412480.0 - 10) == \
        pytest.approx(10.0)
    assert retry_after("soon", 0.0) is None and retry_after(None, 0.0) is None


_DAEMON = textwrap.dedent("""
    import sys, time
    from ac_observe.daemon.alerting.outbox import WebhookSender
    from ac_observe.daemon.alerting.receivers import Receiver
    from ac_observe.daemon.store import Store
    store = Store(sys.argv[1] or None, state_dir=sys.argv[2])
    sender = WebhookSender(store, {"ops": Receiver("ops", sys.argv[3], secret=sys.argv[4])})
    print(sender.send_test(host="n")[0], flush=True)
    sender.run_once()  # posts to a receiver that hangs: killed mid-post
    """)


def test_killed_mid_post_the_delivery_still_arrives_once_under_its_id(store, receiver,
                                                                      tmp_path):
    receiver.mode = "hang"
    url = "" if store.is_sqlite else store.url
    process = subprocess.Popen([sys.executable, "-c", _DAEMON, url, str(tmp_path / "state"),
                                receiver.url, SECRET], stdout=subprocess.PIPE, text=True)
    delivery_id = process.stdout.readline().strip()
    deadline = time.time() + 30
    while not receiver.requests and time.time() < deadline:
        time.sleep(0.05)
    assert receiver.requests, "the first daemon never posted"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert store.delivery(delivery_id)["state"] == PENDING
    # A new daemon: the claim's lease (60 s + the receiver's timeout) must pass first.
    receiver.mode = "ok"
    clock = _Clock()
    restarted = _sender(store, receiver, clock)
    assert restarted.run_once() == 0
    clock.now += 120
    assert restarted.run_once() == 1
    assert store.delivery(delivery_id)["state"] == DELIVERED
    assert [h["webhook-id"] for h, _ in receiver.requests] == [delivery_id, delivery_id]


@pytest.mark.parametrize("text, where", [
    ("receivers:\n  - {name: a, url: 'ftp://x/y'}\n", "receivers[0] (a).url: ftp scheme"),
    ("receivers:\n  - {name: a, url: 'http:///y'}\n", "receivers[0] (a).url: no host"),
    ("receivers:\n  - {name: a, url: 'http://h:99999/'}\n", "receivers[0] (a).url: "),
    ("receivers:\n  - {url: 'http://h/'}\n", "receivers[0].name: "),
    ("receivers:\n  - {url: 'http://h/'}\n", "receivers[0].name: a name of 1-200 characters"),
    ("receivers:\n  - {name: a}\n", "receivers[0] (a).url: a URL is required"),
    ("receivers:\n  - {name: a, url: 'http://h/', zeta: 1, alpha: 2}\n",
     "receivers[0]: unknown field 'alpha'"),
    ("receivers:\n  - {name: a, url: 'http://h/'}\n  - {name: a, url: 'http://g/'}\n",
     "receivers[1] (a).name: 'a' is used twice"),
    ("receivers:\n  - {name: a, url: 'http://h/', secret: 'whsec_c2hvcnQ='}\n",
     "receivers[0] (a).secret: the secret is shorter than 24 bytes"),
    ("receivers:\n  - {name: a, url: 'http://h/', secret: '!!!'}\n",
     "receivers[0] (a).secret: not a Standard Webhooks secret"),
    ("receivers:\n  - {name: a, url: 'http://h/', secret_env: AC_TEST_UNSET_VAR}\n",
     "receivers[0] (a).secret_env: $AC_TEST_UNSET_VAR is unset"),
    ("receivers:\n  - {name: a, url: 'http://h/', format: teams}\n",
     "receivers[0] (a).format: 'teams' is not one of"),
    (f"receivers:\n  - {{name: g, url: 'http://h/', format: grafana, secret: '{SECRET}'}}\n",
     "receivers[0] (g).secret: format grafana takes no secret"),
    ("receivers:\n  - {name: a, url: 'http://h/', token: glsa_x}\n",
     "receivers[0] (a).token: format alertmanager takes no token"),
    ("receivers:\n  - {name: g, url: 'http://h/', format: grafana, token: 'a b'}\n",
     "receivers[0] (g).token: a token is one line without spaces"),
    ("receivers:\n  - {name: g, url: 'http://h/', format: grafana, token_file: /nonexistent/t}\n",
     "receivers[0] (g).token_file: No such file or directory: /nonexistent/t"),
    ("receivers:\n  - {name: a, url: 'http://h/', retries: 3}\n",
     "receivers[0]: unknown field 'retries'"),
    ("receivers: {name: a}\n", "receivers: must be a list"),
    ("recievers: []\n", "unknown section 'recievers'"),
    ("receivers: [\n", "not YAML"),
])
def test_a_bad_alerting_file_names_the_file_and_the_field(tmp_path, text, where):
    path = tmp_path / "alerts.yaml"
    path.write_text(text)
    with pytest.raises(AlertConfigError) as error:
        load_alerting(path)
    assert str(error.value).startswith(f"{path}: ")
    assert where in str(error.value)


def test_a_file_that_is_not_yaml_is_refused_without_quoting_its_lines(tmp_path):
    """A reload logs why a file was refused (and answers it to POST /-/reload): the YAML
    parser's own message quotes the broken line, which may carry a secret."""
    path = tmp_path / "alerts.yaml"
    path.write_text("receivers:\n  - name: ops\n    url: 'https://hooks.example/x'\n"
                    f"    secret: {SECRET}: oops\n")
    with pytest.raises(AlertConfigError) as error:
        load_alerting(path)
    message = str(error.value)
    assert "not YAML" in message and "line 4" in message, message
    assert SECRET[-12:] not in message, message  # (the parser quotes the line's end)


def test_a_good_alerting_file(tmp_path, monkeypatch):
    (tmp_path / "secret").write_text(SECRET + "\n")
    monkeypatch.setenv("AC_TEST_SECRET", SECRET)
    path = tmp_path / "alerts.yaml"
    path.write_text(f"receivers:\n"
                    f"  - {{name: ops, url: 'https://hooks.example/x', secret_file: "
                    f"'{tmp_path / 'secret'}'}}\n"
                    f"  - {{name: chat, url: 'http://127.0.0.1:1/s', format: slack, "
                    f"secret_env: AC_TEST_SECRET, timeout_seconds: 3}}\n")
    receivers = load_alerting(path)
    assert receivers["ops"] == Receiver("ops", "https://hooks.example/x", "alertmanager",
                                        SECRET, 10.0)
    assert receivers["chat"].format == "slack" and receivers["chat"].timeout_seconds == 3
    assert SECRET not in repr(receivers)


@pytest.mark.stack
def test_the_body_is_the_one_alertmanager_itself_posts(tmp_path, receiver):
    """The real Alertmanager, given the same alert, posts a webhook body with the same
    fields, group key, common labels and fingerprint as ours."""
    import socket

    from ac_observe.daemon.alerting.alert import Alert
    from ac_observe.daemon.alerting.notify.alertmanager import alertmanager_body

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "am.yml").write_text(textwrap.dedent(f"""
        route: {{receiver: hook, group_by: ['...'], group_wait: 0s, group_interval: 1s}}
        receivers:
          - name: hook
            webhook_configs: [{{url: '{receiver.url}', send_resolved: true}}]
        """))
    am = start_process(["prometheus-alertmanager", f"--config.file={tmp_path / 'am.yml'}",
                        f"--storage.path={tmp_path / 'am'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        "--cluster.listen-address="],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx
        labels = {"alertname": "InferenceLatencyDrift", "engine": "e1", "severity": "warning"}
        annotations = {"summary": "p95 up 22 %", "runbook": "see the README"}
        starts = time.time() - 5
        deadline = time.time() + 30
        while True:
            try:
                httpx.post(f"http://127.0.0.1:{port}/api/v2/alerts", json=[{
                    "labels": labels, "annotations": annotations,
                    "startsAt": datetime_rfc3339(starts)}], timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.time() < deadline, "Alertmanager did not start"
                time.sleep(0.2)
        while not receiver.requests:
            assert time.time() < deadline, "Alertmanager posted nothing"
            time.sleep(0.1)
    finally:
        am.terminate()
        am.wait()
    theirs = json.loads(receiver.requests[0][1])
    ours = alertmanager_body("hook", [Alert(labels, annotations, "firing", starts)],
                             f"http://127.0.0.1:{port}")
    assert set(ours) == set(theirs)
    for key in ("version", "groupKey", "status", "receiver", "groupLabels", "commonLabels",
                "commonAnnotations", "truncatedAlerts"):
        assert ours[key] == theirs[key], key
    (mine,), (real,) = ours["alerts"], theirs["alerts"]
    assert set(mine) == set(real)
    for key in ("status", "labels", "annotations", "fingerprint"):
        assert mine[key] == real[key], key


def datetime_rfc3339(seconds: float) -> str:
    from ac_observe.daemon.alerting.alert import rfc3339
    return rfc3339(seconds)


def _alerting_file(tmp_path, url) -> str:
    path = tmp_path / "alerts.yaml"
    path.write_text(f"receivers:\n  - {{name: ops, url: '{url}', secret: '{SECRET}'}}\n")
    return str(path)


def test_the_daemon_delivers_and_exports_its_outbox(tmp_path, receiver):
    from ac_observe.daemon.config import DaemonConfig
    from ac_observe.daemon.service import Daemon

    daemon = Daemon(DaemonConfig(telemetry_root=tmp_path / "t", collectors=("engine",),
                                 alerting_file=_alerting_file(tmp_path, receiver.url),
                                 state_dir=tmp_path / "state", node_name="n1"))
    receiver.mode = "500"
    daemon.start()
    try:
        (delivery_id,) = daemon.webhooks.send_test(host="n")
        deadline = time.time() + 20

        def metrics_once(outcome: str, depth: int) -> dict:
            # The pass counts the outcome, then refreshes the queue figures: wait for both.
            while daemon.webhooks.outcomes["ops", outcome] < 1 or \
                    daemon.webhooks.queue.get("ops", (0, 0.0))[0] != depth:
                assert time.time() < deadline
                time.sleep(0.05)
            daemon.run_cycle()
            return parse_metrics(daemon.render_metrics().decode())

        metrics = metrics_once("retried", depth=1)
        assert metrics["ac_webhook_deliveries_total", frozenset(
            {"node": "n1", "receiver": "ops", "outcome": "retried"}.items())] >= 1
        assert metrics["ac_webhook_queue_depth", frozenset(
            {"node": "n1", "receiver": "ops"}.items())] == 1
        receiver.mode = "ok"
        metrics = metrics_once("delivered", depth=0)
        text = daemon.render_metrics().decode()
        assert ('ac_webhook_deliveries_total{node="n1",receiver="ops",outcome="delivered"} '
                '1.0') in text
        assert 'ac_webhook_queue_depth{node="n1",receiver="ops"} 0.0' in text
        assert 'ac_webhook_oldest_pending_seconds{node="n1",receiver="ops"} 0.0' in text
    finally:
        daemon.close()
    assert {h["webhook-id"] for h, _ in receiver.requests} == {delivery_id}
    assert (tmp_path / "state" / "ac-observe.db").exists()


def test_alerts_test_command(tmp_path, receiver):
    env = {**os.environ, "AC_OBSERVE_STATE_DIR": str(tmp_path / "state")}

    def alerts_test(path) -> subprocess.CompletedProcess:
        return subprocess.run([os.path.join(os.path.dirname(sys.executable), "ac-observe"),
                               "alerts", "test", "--alerting", str(path)],
                              capture_output=True, text=True, env=env, timeout=60)

    run = alerts_test(_alerting_file(tmp_path, receiver.url))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ops: delivered (200) webhook-id msg_")
    (headers, body), = receiver.requests
    Webhook(SECRET).verify(body, headers)
    receiver.mode = "500"
    run = alerts_test(_alerting_file(tmp_path, receiver.url))
    assert run.returncode == 1 and run.stdout.startswith("ops: pending (500)")
    bad = tmp_path / "bad.yaml"
    bad.write_text("receivers:\n  - {name: ops, url: 'gopher://x/'}\n")
    run = alerts_test(bad)
    assert run.returncode == 2 and f"{bad}: receivers[0] (ops).url: gopher scheme" in run.stderr
    # Rules the daemon would refuse: nothing is sent, as the daemon would not start.
    sent = len(receiver.requests)
    bad.write_text(f"receivers:\n  - {{name: ops, url: '{receiver.url}', secret: '{SECRET}'}}\n"
                   "rules:\n  - {name: R, metric: inference_latency_ns, statistic: p95,\n"
                   "     window: 1m, comparison: above, threshold: one}\n")
    run = alerts_test(bad)
    assert run.returncode == 2 and "threshold" in run.stderr and str(bad) in run.stderr
    assert len(receiver.requests) == sent


def test_a_reload_adding_a_receiver_never_changes_a_table_being_read(store, receiver):
    """The cycle reads `outcomes` (for /metrics) and the evaluator `wake`s every receiver
    while a reload may add one: the reload swaps in new tables, so a reader midway through
    the old one finishes it (an in-place insert raised 'dictionary changed size during
    iteration' in that reader)."""
    sender = _sender(store, receiver, _Clock())
    try:
        outcomes, wakes = iter(sender.outcomes.items()), iter(sender._wakes.values())
        next(outcomes), next(wakes)
        sender.replace_receivers({**sender.receivers, "new": Receiver(
            "new", receiver.url, secret=SECRET, timeout_seconds=5)})
        list(outcomes), list(wakes)  # the readers finish what they began
        assert {name for name, _ in sender.outcomes} == {"ops", "new"}
        sender._count("ops", "delivered")
        assert sender.outcomes["ops", "delivered"] == 1
    finally:
        sender.stop()
