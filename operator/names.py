"""Names of the KVServing custom resource (DESIGN.md, Operator)."""

GROUP = "kvserving.dev"
VERSION = "v1alpha1"
KIND = "KVServing"
PLURAL = "kvservings"
SHORT_NAME = "kvs"
CRD_NAME = f"{PLURAL}.{GROUP}"
