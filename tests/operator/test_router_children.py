"""spec.router: the router's Deployment, Services and RBAC appear, stand in front of the runtime
pods, are repaired like every child, and go away again when the router is turned off (issue 17)."""

from quire_operator import names

from operator_harness import cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)

RBAC = "rbac.authorization.k8s.io/v1"
ROUTER = {"quire.dev/router": "chat"}
RUNTIME = {names.SELECTOR_LABEL: "chat"}


def router_objects(cluster):
    return {
        "ServiceAccount": cluster.get("v1", "serviceaccounts", "chat-router"),
        "Role": cluster.get(RBAC, "roles", "chat-router"),
        "RoleBinding": cluster.get(RBAC, "rolebindings", "chat-router"),
        "Deployment": cluster.deployment("chat-router"),
        "headless Service": cluster.service("chat-pods"),
    }


def test_router_children_are_created_and_removed_with_spec_router(cluster):
    with running_operator():
        llmd = cluster.create(llmdeployment("chat", port=9000, router={"enabled": True, "routing": "least-load"}))
        objects = wait_for(lambda: (o := router_objects(cluster)) and all(o.values()) and o,
                           what="the router's children")
        # Clients keep the address they had: the main Service now selects the router pods.
        service = wait_for(lambda: (s := cluster.service("chat")) and s["spec"]["selector"] == ROUTER and s,
                           what="the main Service to select the router pods")
        assert service["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]

        uid = llmd["metadata"]["uid"]
        for kind, obj in objects.items():
            (ref,) = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["uid"], ref["controller"]) == ("LLMDeployment", uid, True), kind
            assert obj["metadata"]["labels"][names.MANAGED_BY_LABEL] == names.MANAGED_BY, kind

        # The runtime pods keep a headless Service: the router's backends (its EndpointSlices).
        headless = objects["headless Service"]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["selector"] == RUNTIME
        router = objects["Deployment"]
        template = router["spec"]["template"]
        # Router pods never match the runtime Deployment's selector, nor the runtime pods the router's.
        assert router["spec"]["selector"]["matchLabels"] == ROUTER
        assert names.SELECTOR_LABEL not in template["metadata"]["labels"]
        assert template["spec"]["serviceAccountName"] == "chat-router"
        (container,) = template["spec"]["containers"]
        assert container["args"][:1] == ["router"]
        assert "--k8s-service" in container["args"] and "chat-pods" in container["args"]
        assert objects["Role"]["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                             "verbs": ["list", "watch"]}]
        assert objects["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router",
                                                       "namespace": "default"}]
        assert cluster.deployment("chat")["spec"]["selector"]["matchLabels"] == RUNTIME

        # Drift: the router's children are watched and restored like the others.
        cluster.delete(RBAC, "roles", "chat-router")
        wait_for(lambda: cluster.get(RBAC, "roles", "chat-router"), what="the Role to come back")
        cluster.patch("v1", "services", "chat", {"spec": {"selector": RUNTIME}})
        wait_for(lambda: cluster.service("chat")["spec"]["selector"] == ROUTER,
                 what="the main Service's selector restored")

        # Turned off: every router object goes, and the Service points at the runtime pods again.
        cluster.patch("quire.dev/v1alpha1", names.PLURAL, "chat", {"spec": {"router": {"enabled": False}}})
        wait_for(lambda: not any(router_objects(cluster).values()), timeout=30,
                 what="the router's children to be deleted")
        wait_for(lambda: cluster.service("chat")["spec"]["selector"] == RUNTIME, timeout=30,
                 what="the main Service to select the runtime pods again")
        deleted = wait_for(lambda: [e["message"] for e in cluster.events("chat") if e["reason"] == "Deleted"],
                           what="Deleted Events")
        assert any("Deployment chat-router deleted" in m for m in deleted), deleted
        assert cluster.deployment("chat") is not None  # the runtime pods stay
