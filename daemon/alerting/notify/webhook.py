"""Posting a body to a webhook receiver, signed per Standard Webhooks: each attempt is
signed afresh (a new `webhook-timestamp`) under the delivery's one `webhook-id`, so a
receiver dedupes retries by that id."""
from __future__ import annotations

from datetime import datetime, timezone

import httpx

from ac_observe.daemon.alerting.receivers import Receiver


def signed_headers(receiver: Receiver, delivery_id: str, body: str, now: float) -> dict:
    headers = {"content-type": "application/json", "user-agent": "ac-observe",
               "webhook-id": delivery_id, "webhook-timestamp": str(int(now))}
    signer = receiver.signer()
    if signer is not None:
        stamp = datetime.fromtimestamp(int(now), tz=timezone.utc)
        headers["webhook-signature"] = signer.sign(delivery_id, stamp, body)
    return headers


def post(client: httpx.Client, receiver: Receiver, delivery_id: str, body: str,
         now: float) -> httpx.Response:
    return client.post(receiver.url, content=body.encode(),
                       headers=signed_headers(receiver, delivery_id, body, now),
                       timeout=receiver.timeout_seconds)
