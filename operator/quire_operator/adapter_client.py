"""The runtime's adapter API, as one replica answers it (vLLM's contract):

    GET  /v1/models                 {"data": [{"id", "root", "parent"}, ...]}: adapters have a parent
    POST /v1/load_lora_adapter      {"lora_name", "lora_path"} → 200; 400 with the reason
    POST /v1/unload_lora_adapter    {"lora_name"} → 200; 404 when it is not loaded
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from .scrape import pod_opener, pod_url

# Loading reads the adapter's weights from disk and packs them: allow longer than a scrape.
LIST_TIMEOUT_SECONDS = 5.0
LOAD_TIMEOUT_SECONDS = 60.0


class AdapterApiError(Exception):
    """The replica refused (status is its HTTP status) or did not answer (status None)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message if status is None else f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class RuntimeAdapters:
    """One replica's adapter endpoints; `tls`: it speaks HTTPS, verified with this (spec.tls)."""

    def __init__(self, ip: str, port: int, api_key: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.base = pod_url(ip, port, "", tls)
        self.api_key = api_key
        self._opener = pod_opener(tls)  # pod IPs: no proxy

    def loaded(self) -> dict[str, str]:
        """Adapter name → the path it was loaded from ("root"), for every adapter the replica serves."""
        body = self._call("GET", "/v1/models", None, LIST_TIMEOUT_SECONDS)
        try:
            models = json.loads(body)["data"]
            return {m["id"]: str(m.get("root") or "") for m in models if m.get("parent")}
        except (ValueError, KeyError, TypeError) as e:
            raise AdapterApiError(None, f"/v1/models answered something unexpected: {e}") from e

    def load(self, name: str, path: str) -> None:
        self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, LOAD_TIMEOUT_SECONDS)

    def unload(self, name: str) -> None:
        self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name}, LIST_TIMEOUT_SECONDS)

    def _call(self, method: str, path: str, payload: Mapping[str, Any] | None, timeout: float) -> str:
        headers = {"Accept": "application/json"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=timeout) as response:
                return response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            raise AdapterApiError(e.code, _reason(e.read().decode("utf-8", errors="replace"))) from e
        except Exception as e:  # refused, reset, timed out: the replica did not answer
            raise AdapterApiError(None, f"no answer from {self.base}{path}: {e}") from e


def _reason(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message"}}, or FastAPI's "detail"), else the text."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        for key in ("message", "detail", "error"):
            if isinstance(parsed.get(key), str):
                return parsed[key][:500]
    if isinstance(parsed, str):
        return parsed[:500]
    return body.strip()[:500]
