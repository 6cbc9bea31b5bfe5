"""A small Kubernetes client: plain dicts in and out, one method per call the operator makes.

It sits on the `kubernetes` package's ApiClient (configuration, auth, TLS) and checks each call
against api_calls.API_CALLS, so the RBAC list cannot fall behind the code.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import kubernetes

from . import api_calls, names

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_SECONDS = 30


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason


class UndeclaredApiCall(RuntimeError):
    """A call missing from api_calls.API_CALLS: the RBAC rules would refuse it in a cluster."""


def resource_path(group: str, version: str, plural: str, namespace: str | None,
                  name: str | None = None, subresource: str | None = None) -> str:
    path = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    if namespace:
        path += f"/namespaces/{quote(namespace)}"
    path += f"/{plural}"
    if name:
        path += f"/{quote(name)}"
    if subresource:
        path += f"/{subresource}"
    return path


def load_config() -> None:
    """In-cluster service account first, then the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        # Read KUBECONFIG now: the kubernetes package reads it once, when first imported.
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient | None = None) -> None:
        self._api_client = api_client

    def use(self, api_client: kubernetes.client.ApiClient) -> None:
        """Switch to a client built from the configuration loaded just now."""
        self._api_client = api_client

    @property
    def api_client(self) -> kubernetes.client.ApiClient:
        if self._api_client is None:
            self._api_client = kubernetes.client.ApiClient()
        return self._api_client

    def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                body: Any = None, content_type: str | None = None) -> dict:
        call = api_calls.classify(method, path)
        if call is not None and not api_calls.allowed(*call):
            raise UndeclaredApiCall(f"{method} {path} is {call}, which api_calls.API_CALLS does not list")
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        if query:
            path += "?" + urlencode(query)
        client = self.api_client
        method_, url, headers, body, _ = client.param_serialize(
            method=method, resource_path=path, header_params=headers, body=body, auth_settings=["BearerToken"])
        response = client.call_api(method_, url, header_params=headers, body=body,
                                   _request_timeout=TIMEOUT_SECONDS)
        data = response.read()
        payload = json.loads(data) if data else {}
        if not 200 <= response.status < 300:
            raise ApiError(response.status, payload.get("reason", response.reason or ""),
                           payload.get("message", data.decode(errors="replace")[:200]))
        return payload

    # --- reads ---

    def get(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict | None:
        try:
            return self.request("GET", resource_path(group, version, plural, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def get_llmdeployment(self, namespace: str, name: str) -> dict | None:
        return self.get(names.GROUP, names.VERSION, names.PLURAL, namespace, name)

    # --- writes ---

    def create(self, group: str, version: str, plural: str, namespace: str, body: Mapping[str, Any]) -> dict:
        return self.request("POST", resource_path(group, version, plural, namespace), body=dict(body))

    def patch(self, group: str, version: str, plural: str, namespace: str, name: str,
              patch: Mapping[str, Any], subresource: str | None = None) -> dict:
        return self.request("PATCH", resource_path(group, version, plural, namespace, name, subresource),
                            body=dict(patch), content_type=MERGE_PATCH)

    def delete(self, group: str, version: str, plural: str, namespace: str, name: str) -> None:
        try:
            self.request("DELETE", resource_path(group, version, plural, namespace, name))
        except ApiError as e:
            if e.status != 404:
                raise

    def patch_llmdeployment_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict:
        return self.patch(names.GROUP, names.VERSION, names.PLURAL, namespace, name,
                          {"status": dict(status)}, subresource="status")

    def get_scale(self, namespace: str, name: str) -> dict:
        return self.request("GET", resource_path(names.GROUP, names.VERSION, names.PLURAL, namespace, name, "scale"))

    def set_replicas(self, namespace: str, name: str, replicas: int) -> dict:
        """Through the /scale subresource, as HPA does: only spec.replicas changes."""
        return self.patch(names.GROUP, names.VERSION, names.PLURAL, namespace, name,
                          {"spec": {"replicas": replicas}}, subresource="scale")


# One client for the whole operator, configured at startup (handlers.configure).
kube = Kube()
