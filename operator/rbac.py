"""The API permissions the operator needs, derived from its code: the calls in
kube.API_CALLS plus those kopf makes for the handlers in handlers.registry
under handlers.configure's settings. The ClusterRole in manifests/ must equal
``cluster_role_rules()`` (a test checks both directions)."""

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


def cluster_role_rules() -> list[dict[str, Any]]:
    """Permissions as PolicyRules: one rule per (group, resource), verbs sorted."""
    by_resource: dict[tuple[str, str], set[str]] = {}
    for verb, group, resource in required_permissions():
        by_resource.setdefault((group, resource), set()).add(verb)
    return [
        {"apiGroups": [group], "resources": [resource], "verbs": sorted(verbs)}
        for (group, resource), verbs in sorted(by_resource.items())
    ]
