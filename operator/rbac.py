"""The API permissions the operator needs, derived from its code: the calls in
kube.API_CALLS plus those kopf makes for the handlers in handlers.registry
under handlers.configure's settings. The roles in manifests/ must equal
``cluster_role_rules()`` (a test checks both directions).

Every call is namespaced (the operator lists no namespaces and watches no
CRDs), so an operator that watches given namespaces (``--namespace``) needs
only a Role in each of them; only the cluster-wide operator needs a
ClusterRole (``rbac_objects``; ``kvserving operator --print-rbac``).

Secrets: ``create`` (the internal credential, once) and ``get`` (the KV-health
sampler reads it); no list, watch, patch or delete: garbage collection
deletes the Secret with its KVServing."""

from __future__ import annotations

from typing import Any

import kopf

from kvserving.operator import handlers, kube

Permission = tuple[str, str, str]  # (verb, group, resource)


def kopf_permissions(registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings) -> set[Permission]:
    perms: set[Permission] = set()
    # kopf keeps no public accessor for a registry's resources; these are its
    # sub-registries. Every handled resource is listed and watched; change
    # handlers (and timers/daemons) also patch it: progress and diffbase annotations.
    # Event and index handlers keep no state on the object, so no patch.
    stateful = registry._changing.get_all_selectors() | registry._spawning.get_all_selectors()
    stateless = registry._watching.get_all_selectors() | registry._indexing.get_all_selectors()
    for sel in stateful | stateless:
        group = sel.group or ""
        plural = sel.plural or ""
        perms |= {("list", group, plural), ("watch", group, plural)}
        if sel in stateful:
            perms.add(("patch", group, plural))
    if settings.posting.enabled:
        perms.add(("create", "", "events"))  # kopf.event() and kopf's own warnings
    if not settings.peering.standalone:
        raise ValueError("peering would need kopf.dev peering permissions; the operator runs standalone")
    if not settings.scanning.disabled:
        raise ValueError("scanning would need cluster-wide CRD and namespace watching; it is disabled")
    return perms


def required_permissions() -> set[Permission]:
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    return set(kube.API_CALLS) | kopf_permissions(handlers.registry, settings)


NAME = "kvserving-operator"
SYSTEM_NAMESPACE = "kvserving-system"
LABELS = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "kvserving"}
RBAC_API = "rbac.authorization.k8s.io"


def cluster_role_rules() -> list[dict[str, Any]]:
    """Permissions as PolicyRules: one rule per (group, resource), verbs sorted."""
    by_resource: dict[tuple[str, str], set[str]] = {}
    for verb, group, resource in required_permissions():
        by_resource.setdefault((group, resource), set()).add(verb)
    return [
        {"apiGroups": [group], "resources": [resource], "verbs": sorted(verbs)} for (group, resource), verbs in sorted(by_resource.items())
    ]


def rbac_objects(namespaces: list[str]) -> list[dict[str, Any]]:
    """The ServiceAccount and the role bindings for an operator that watches
    ``namespaces`` (empty: all). Cluster-wide: a ClusterRole and its binding,
    the operator in kvserving-system. Namespaced: a Role and RoleBinding in each
    watched namespace, the operator (its ServiceAccount) in the first one."""
    home = namespaces[0] if namespaces else SYSTEM_NAMESPACE
    account: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": NAME, "namespace": home, "labels": dict(LABELS)},
    }
    subject = [{"kind": "ServiceAccount", "name": NAME, "namespace": home}]
    if not namespaces:
        return [
            account,
            {
                "apiVersion": f"{RBAC_API}/v1",
                "kind": "ClusterRole",
                "metadata": {"name": NAME, "labels": dict(LABELS)},
                "rules": cluster_role_rules(),
            },
            {
                "apiVersion": f"{RBAC_API}/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": NAME, "labels": dict(LABELS)},
                "roleRef": {"apiGroup": RBAC_API, "kind": "ClusterRole", "name": NAME},
                "subjects": subject,
            },
        ]
    objects: list[dict[str, Any]] = [account]
    for namespace in namespaces:
        meta = {"name": NAME, "namespace": namespace, "labels": dict(LABELS)}
        objects.append({"apiVersion": f"{RBAC_API}/v1", "kind": "Role", "metadata": dict(meta), "rules": cluster_role_rules()})
        objects.append(
            {
                "apiVersion": f"{RBAC_API}/v1",
                "kind": "RoleBinding",
                "metadata": dict(meta),
                "roleRef": {"apiGroup": RBAC_API, "kind": "Role", "name": NAME},
                "subjects": subject,
            }
        )
    return objects
