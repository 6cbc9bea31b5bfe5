"""What makes the operator's pods pass Kubernetes' "restricted" Pod Security Standard, and the
writable folders a read-only root filesystem leaves them.

The serving image's user is uid/gid 1000 (the Dockerfile). With the root filesystem read-only,
`quire serve` and `quire router` write only to two emptyDirs: /tmp (TMPDIR: torch's and the C++
compiler's temporary files) and the home folder (HOME; XDG_CACHE_HOME under it: the GGUF
conversion cache, the native kernel builds, the Hugging Face and Triton caches). The runtime
finds both from those variables (quire/writable_dirs.py). Variables the spec's env sets itself
are left as it sets them.
"""

from __future__ import annotations

RUN_AS = 1000  # the serving image's USER
HOME = "/home/quire"  # the image's HOME, mounted writable
TMP = "/tmp"

WRITABLE_ENV = {
    "HOME": HOME,
    "XDG_CACHE_HOME": f"{HOME}/.cache",
    "TMPDIR": TMP,
    # Python would try to write bytecode next to the installed sources, on the read-only root.
    "PYTHONDONTWRITEBYTECODE": "1",
}
_VOLUMES = (("home", HOME), ("tmp", TMP))


def pod_security_context(fs_group: bool = True) -> dict:
    """Run as the image's non-root user under the runtime's default seccomp profile;
    fsGroup makes mounted volumes (a model or cache claim) the group's."""
    context = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
               "seccompProfile": {"type": "RuntimeDefault"}}
    if fs_group:
        context["fsGroup"] = RUN_AS
    return context


def container_security_context() -> dict:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True}


def writable_volumes() -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts): the emptyDirs a read-only root leaves writable."""
    volumes = [{"name": name, "emptyDir": {}} for name, _ in _VOLUMES]
    mounts = [{"name": name, "mountPath": path} for name, path in _VOLUMES]
    return volumes, mounts


def writable_env(env: list[dict]) -> list[dict]:
    """WRITABLE_ENV's variables that `env` does not set already."""
    taken = {item.get("name") for item in env}
    return [{"name": name, "value": value} for name, value in WRITABLE_ENV.items() if name not in taken]
