"""`ac-observe dashboards push`: the generated dashboards into a Grafana reached over its
HTTP API (grafana-client), for instances that are not file-provisioned (Grafana Cloud)."""
from __future__ import annotations

import json

from ac_observe.dashboards import generate, grafana


class PushError(RuntimeError):
    pass


def retarget(model: dict, datasource_uid: str) -> dict:
    """The model with every datasource reference pointing at `datasource_uid`."""
    text = json.dumps(model)
    return json.loads(text.replace(f'"uid": "{grafana.DATASOURCE_UID}"',
                                   f'"uid": {json.dumps(datasource_uid)}'))


def push(url: str, token: str | None, folder: str = "ac-observe",
         datasource_uid: str | None = None, rules=None):
    """Creates the folder if needed and uploads every dashboard (overwriting the previous
    version of each, by uid); yields a line per step."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException
    if not url.startswith(("http://", "https://")):
        raise PushError(f"the Grafana URL must start with http:// or https://: {url!r}")
    api = GrafanaApi.from_url(url, credential=token or None, timeout=30.0)
    folder_uid = "ac-observe-" + "".join(c if c.isalnum() else "-" for c in folder.lower())[:28]
    try:
        try:
            api.folder.get_folder(folder_uid)
        except GrafanaClientError as exc:
            if getattr(exc, "status_code", None) != 404:
                raise
            api.folder.create_folder(folder, uid=folder_uid)
            yield f"created folder {folder!r}"
        for board in generate.boards(rules):
            model = grafana.build(board)
            if datasource_uid:
                model = retarget(model, datasource_uid)
            model.pop("id", None)
            answer = api.dashboard.update_dashboard({
                "dashboard": model, "folderUid": folder_uid, "overwrite": True,
                "message": "ac-observe dashboards push"})
            yield (f"{board.title}: {answer.get('status', 'ok')} "
                   f"{url.rstrip('/')}{answer.get('url', '')}")
    except GrafanaException as exc:
        raise PushError(f"Grafana at {url} refused: {exc}") from None
    except Exception as exc:  # niquests' connection errors and the like
        raise PushError(f"cannot reach Grafana at {url}: {type(exc).__name__}: "
                        f"{exc}") from None
