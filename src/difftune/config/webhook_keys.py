"""Webhooks (`webhook_config`, `webhook_reporting_interval`): the fields, mixed into TrainConfig, the reading of the
webhook list, and its checks (this mixin's validator). Import-light: no torch. The sending is train/webhooks.py.

SimpleTuner's format: `webhook_config` is the path of a JSON file, or the JSON itself (text starting with '{' or '[',
or an object/list written straight into config.json), holding one webhook object or a list of them:
- `webhook_type`: 'discord' (a Discord channel's webhook: messages with the validation images attached) or 'raw'
  (structured JSON events POSTed to your own endpoint);
- `webhook_url` (discord) / `callback_url` (raw): where to POST, http(s);
- `message_prefix`: shown before each Discord message, as "`(prefix)` " (default: tracker_project_name);
- `log_level`: the least severe message sent: 'critical', 'error', 'warning', 'info' (default) or 'debug';
- `ssl_no_verify`: true to accept any TLS certificate (a self-signed endpoint).

A webhook URL is a secret (a Discord URL lets anyone post to the channel): messages about it show `masked` only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, field_validator, model_validator

from difftune.config.fields import field
from difftune.files import read_settings_text

WEBHOOK_TYPES = {"discord": "webhook_url", "raw": "callback_url"}  # type -> the key holding its URL
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # most severe first (SimpleTuner's scale)
WEBHOOK_ENTRY_KEYS = ("webhook_type", "webhook_url", "callback_url", "message_prefix", "log_level", "ssl_no_verify")


@dataclass(frozen=True)
class Webhook:
    kind: str  # 'discord' or 'raw'
    url: str
    message_prefix: str | None = None
    log_level: str = "info"
    ssl_no_verify: bool = False

    @property
    def masked(self) -> str:
        return mask_url(self.url)

    def wants(self, level: str) -> bool:
        """Whether a message of `level` is sent to this webhook (its log_level or more severe)."""
        return LOG_LEVELS.index(level) <= LOG_LEVELS.index(self.log_level)


def mask_url(url: str) -> str:
    """The URL without its secret parts: scheme and host only (a Discord URL's path holds its token)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid URL>"
    return f"{parts.scheme}://{host}{port}/***"


def is_inline(text: str) -> bool:
    """JSON written into the key itself rather than a file's path (SimpleTuner's test: it starts with '{')."""
    return text.lstrip().startswith(("{", "["))


def read_webhooks(value: str) -> list[Webhook]:
    """The webhooks of a webhook_config value (a path, or inline JSON); ValueError naming the fix."""
    if is_inline(value):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"its inline JSON is not valid (line {e.lineno}, column {e.colno}: {e.msg}); write "
                             "it as JSON, or give the path of a JSON file") from None
        where = "its JSON"
    else:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"{value}: no such file; give the path of a JSON file holding a webhook object or a "
                             "list of them (or write the JSON itself)")
        try:
            data = json.loads(read_settings_text(path))
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {value}: {e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{value} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
        where = str(value)
    entries = [data] if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where} must hold a webhook object or a non-empty list of them, e.g. "
                         '{"webhook_type": "discord", "webhook_url": "https://discord.com/api/webhooks/..."}')
    return [_webhook(entry, f"{where}, webhook {i + 1}" if len(entries) > 1 else where)
            for i, entry in enumerate(entries)]


def _webhook(entry: Any, where: str) -> Webhook:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each webhook is a JSON object, not {json.dumps(entry)[:40]}")
    unknown = [key for key in entry if key not in WEBHOOK_ENTRY_KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; a webhook takes " + ", ".join(WEBHOOK_ENTRY_KEYS))
    kind = entry.get("webhook_type")
    if kind not in WEBHOOK_TYPES:
        raise ValueError(f"{where}: webhook_type {kind!r} is not one of " + ", ".join(map(repr, WEBHOOK_TYPES)))
    url_key = WEBHOOK_TYPES[kind]
    other = next(k for t, k in WEBHOOK_TYPES.items() if t != kind)
    if other in entry:
        raise ValueError(f"{where}: a '{kind}' webhook takes its URL as {url_key}, not {other}: rename it")
    url = entry.get(url_key)
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: a '{kind}' webhook needs {url_key}, the http(s) URL to POST to")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: {url_key} {mask_url(url)} is not an http:// or https:// URL with a host")
    level = entry.get("log_level", "info")
    if level not in LOG_LEVELS:
        raise ValueError(f"{where}: log_level {level!r} is not one of " + ", ".join(LOG_LEVELS))
    prefix = entry.get("message_prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"{where}: message_prefix must be text")
    no_verify = entry.get("ssl_no_verify", False)
    if not isinstance(no_verify, bool):
        raise ValueError(f"{where}: ssl_no_verify must be true or false")
    return Webhook(kind, url, prefix, level, no_verify)


def public_value(value: str | None) -> str | None:
    """webhook_config as it may be shown (tracker hyperparameters): a path as is, inline JSON (URLs) hidden."""
    return "<inline webhook JSON>" if value and is_inline(value) else value


class WebhookKeys(BaseModel):
    webhook_config: str | None = field(
        None, "Path of a JSON file describing webhooks that are sent the run's progress, or the JSON itself: one "
        "object or a list, each with webhook_type 'discord' (webhook_url; messages with the validation images "
        "attached) or 'raw' (callback_url; structured JSON events, images as base64), and optionally "
        "message_prefix, log_level ('critical'..'debug', default 'info') and ssl_no_verify. Sent from process 0: "
        "the start, validation samples, checkpoints, warnings, errors and the end (raw: also progress, see "
        "webhook_reporting_interval). Sending runs in the background: a slow or failing endpoint never holds "
        "training up (retried, then a warning); the end of the run waits at most 30 s for unsent messages. The URLs "
        "are secrets: logs show their host only. Empty: no webhooks.", "output", advanced=True,
    )
    webhook_reporting_interval: int | None = field(
        None, "Send a progress event (step, loss, learning rate, speed) to the 'raw' webhooks every N optimizer "
        "steps. Discord webhooks do not get these (SimpleTuner's meaning): they would flood the channel. Empty: no "
        "progress events.", "output", ge=1, advanced=True,
    )

    @field_validator("webhook_config", mode="before")
    @classmethod
    def _webhook_config_text(cls, value: Any) -> Any:
        """An object or list written into config.json is kept as its JSON text (inline JSON)."""
        if isinstance(value, dict | list):
            return json.dumps(value)
        if isinstance(value, str) and value.strip().lower() in ("", "null", "none"):
            return None
        return value

    @model_validator(mode="after")
    def _webhook_checks(self) -> WebhookKeys:
        webhook_checks(self)
        return self

    def webhooks(self) -> list[Webhook]:
        return read_webhooks(self.webhook_config) if self.webhook_config else []


def webhook_checks(cfg: Any) -> None:
    """Raise ValueError for an unusable webhook_config, or an interval that would do nothing."""
    if cfg.webhook_config:
        try:
            hooks = read_webhooks(cfg.webhook_config)
        except ValueError as e:
            raise ValueError(f"webhook_config: {e}") from None
    else:
        hooks = []
    if cfg.webhook_reporting_interval is None:
        return
    if not hooks:
        raise ValueError("webhook_reporting_interval sets how often progress is sent to webhooks, but webhook_config "
                         "is not set: set webhook_config, or remove webhook_reporting_interval")
    if not any(hook.kind == "raw" for hook in hooks):
        raise ValueError("webhook_reporting_interval sends progress to 'raw' webhooks only, and webhook_config has "
                         "none (Discord webhooks get the start, samples, checkpoints and the end): remove "
                         "webhook_reporting_interval, or add a 'raw' webhook")
