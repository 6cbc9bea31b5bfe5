"""A checker for Kubernetes' "restricted" Pod Security Standard, for the pods the chart and the
operator make: `violations(pod_spec)` lists every rule a pod spec breaks.

The rules, as https://kubernetes.io/docs/concepts/security/pod-security-standards/ words them
(the restricted profile is the baseline profile plus its own rules):

Baseline
- HostProcess: Windows host-process pods are forbidden (windowsOptions.hostProcess).
- Host Namespaces: hostNetwork, hostPID and hostIPC must be unset or false.
- Privileged Containers: securityContext.privileged must be unset or false.
- Capabilities: adding any beyond the baseline's default set is forbidden.
- HostPath Volumes: forbidden.
- Host Ports: hostPort must be unset or 0.
- AppArmor / SELinux / procMount / sysctls: not set to the unconfined or unsafe values.
- Seccomp: the Unconfined profile is forbidden.
Restricted
- Volume Types: only configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim,
  projected and secret volumes.
- Privilege Escalation: allowPrivilegeEscalation must be false in every container.
- Running as Non-root: runAsNonRoot must be true, on the pod or on every container (a
  container's own value overrides the pod's).
- Running as Non-root user: runAsUser must not be 0, on the pod or any container.
- Seccomp: seccompProfile.type must be RuntimeDefault or Localhost, on the pod or on every
  container; no container may set Unconfined.
- Capabilities: every container must drop ALL and may add only NET_BIND_SERVICE.

Beyond the standard, Quire's own rule for its pods: readOnlyRootFilesystem must be true in every
container (issue 36), so each writes only to the volumes it mounts.
"""

from __future__ import annotations

from typing import Any

ALLOWED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                        "persistentVolumeClaim", "projected", "secret"}
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SECCOMP_ALLOWED = {"RuntimeDefault", "Localhost"}
VOLUME_KEYS_NOT_TYPES = {"name"}


def violations(pod: dict[str, Any]) -> list[str]:
    """Every restricted-profile rule (and Quire's read-only root rule) `pod` (a PodSpec) breaks."""
    found: list[str] = []
    pod_ctx = pod.get("securityContext") or {}
    containers = [(kind, c) for kind in ("initContainers", "containers", "ephemeralContainers")
                  for c in pod.get(kind) or []]
    if not containers:
        found.append("the pod has no containers")

    # baseline: host namespaces, HostProcess, host paths, sysctls, AppArmor/SELinux
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"Host Namespaces: spec.{field} is true")
    if (pod_ctx.get("windowsOptions") or {}).get("hostProcess"):
        found.append("HostProcess: spec.securityContext.windowsOptions.hostProcess is true")
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"Sysctls: {sysctl.get('name')} is not a safe sysctl")
    found += _selinux_and_apparmor("spec.securityContext", pod_ctx)

    # restricted: volume types (hostPath among the forbidden ones)
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - VOLUME_KEYS_NOT_TYPES
        for kind in kinds - ALLOWED_VOLUME_TYPES:
            found.append(f"Volume Types: volume {volume.get('name')!r} is a {kind} volume")

    # restricted: non-root, seccomp; checked per container with the pod's value as the default
    if pod_ctx.get("runAsUser") == 0:
        found.append("Running as Non-root user: spec.securityContext.runAsUser is 0")
    pod_seccomp = (pod_ctx.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_ALLOWED:
        found.append(f"Seccomp: spec.securityContext.seccompProfile.type is {pod_seccomp}")
    for kind, container in containers:
        where = f"{kind}[{container.get('name')}]"
        ctx = container.get("securityContext") or {}
        found += _container(where, ctx, pod_ctx, pod_seccomp)
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"Host Ports: {where} asks for hostPort {port['hostPort']}")
    return found


def _container(where: str, ctx: dict, pod_ctx: dict, pod_seccomp: str | None) -> list[str]:
    found = []
    if ctx.get("privileged"):
        found.append(f"Privileged Containers: {where} is privileged")
    if (ctx.get("windowsOptions") or {}).get("hostProcess"):
        found.append(f"HostProcess: {where} is a host process")
    if ctx.get("procMount") not in (None, "Default"):
        found.append(f"/proc Mount Type: {where} sets procMount {ctx['procMount']}")
    found += _selinux_and_apparmor(where, ctx)
    if ctx.get("allowPrivilegeEscalation") is not False:
        found.append(f"Privilege Escalation: {where} does not set allowPrivilegeEscalation false")
    if ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is not True:
        found.append(f"Running as Non-root: runAsNonRoot is not true for {where}")
    if ctx.get("runAsUser") == 0:
        found.append(f"Running as Non-root user: {where} sets runAsUser 0")
    seccomp = (ctx.get("seccompProfile") or {}).get("type")
    if seccomp is not None and seccomp not in SECCOMP_ALLOWED:
        found.append(f"Seccomp: {where} sets seccompProfile.type {seccomp}")
    elif seccomp is None and pod_seccomp is None:
        found.append(f"Seccomp: no seccompProfile for {where}, on it or on the pod")
    caps = ctx.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        found.append(f"Capabilities: {where} does not drop ALL")
    added = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
    if added:
        found.append(f"Capabilities: {where} adds {sorted(added)}")
    if ctx.get("readOnlyRootFilesystem") is not True:
        found.append(f"Read-only root (Quire's rule): {where} does not set readOnlyRootFilesystem true")
    return found


def _selinux_and_apparmor(where: str, ctx: dict) -> list[str]:
    found = []
    selinux = ctx.get("seLinuxOptions") or {}
    if selinux.get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t",
                                   "container_engine_t"):
        found.append(f"SELinux: {where} sets seLinuxOptions.type {selinux['type']}")
    if selinux.get("user") or selinux.get("role"):
        found.append(f"SELinux: {where} sets seLinuxOptions user or role")
    if (ctx.get("appArmorProfile") or {}).get("type") == "Unconfined":
        found.append(f"AppArmor: {where} is Unconfined")
    return found


def pod_spec_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The PodSpec inside a workload object (Pod, Deployment, StatefulSet, DaemonSet, Job,
    CronJob, ReplicaSet), or None for an object that makes no pods."""
    kind = obj.get("kind")
    if kind == "Pod":
        return obj["spec"]
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        return obj["spec"]["template"]["spec"]
    return None


def assert_restricted(obj: dict[str, Any]) -> None:
    pod = pod_spec_of(obj)
    assert pod is not None, f"{obj.get('kind')} makes no pods"
    problems = violations(pod)
    assert not problems, f"{obj['kind']} {obj['metadata'].get('name')}: " + "; ".join(problems)
