"""kvCache.calibration: the CRD's optional calibration ConfigMap reference, rendered as a
read-only volume in the workers and a file path in the engine config; the status line that
says where the bits table or global scales come from."""

from __future__ import annotations

from typing import Any

import pytest
from kvs_crd_tools import apply_defaults, load_sample, root_schema

from kvserving.config import ServingConfig
from kvserving.operator.render import Owner, Rendered, render
from kvserving.operator.spec import CALIBRATION_DIR
from kvserving.operator.status import Desired, compute_status

UID = "0b6f4a1e-5d2c-4c7e-9a43-6f1d2e3c4b5a"


def _render(sample: str, **kv: Any) -> Rendered:
    body = apply_defaults(root_schema(), load_sample(sample))
    body["spec"]["kvCache"].update(kv)
    body = apply_defaults(root_schema(), body)  # the key's default, as the API server fills it
    meta = body["metadata"]
    return render(body["spec"], owner=Owner(name=meta["name"], namespace=meta["namespace"], uid=UID))


def _objects(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in rendered.objects}


def _engine_config(rendered: Rendered) -> ServingConfig:
    cm = next(o for o in rendered.objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config"))
    return ServingConfig.from_json(cm["data"]["config.json"])


def test_calibration_configmap_is_mounted_in_the_workers_and_named_in_the_engine_config() -> None:
    rendered = _render("triaxial", calibration={"configMap": "qwen3-8b-calibration"})
    objs = _objects(rendered)
    for role in ("prefill", "decode"):
        pod = objs[f"Deployment/qwen3-triaxial-{role}"]["spec"]["template"]["spec"]
        assert {"name": "calibration", "configMap": {"name": "qwen3-8b-calibration"}} in pod["volumes"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "calibration", "mountPath": CALIBRATION_DIR, "readOnly": True} in mounts
    gateway = objs["Deployment/qwen3-triaxial-gateway"]["spec"]["template"]["spec"]
    assert all(v["name"] != "calibration" for v in gateway["volumes"])
    assert _engine_config(rendered).kv_cache.calibration == "/etc/kvserving/calibration/calibration.json"
    assert rendered.kv_calibration == "calibrated bits table for bitBudget 2.7 from ConfigMap qwen3-8b-calibration"


def test_a_custom_key_is_the_file_name() -> None:
    rendered = _render("fp8_e4m3", calibration={"configMap": "c", "key": "v2.json"}, globalScale="calibrated")
    assert _engine_config(rendered).kv_cache.calibration == "/etc/kvserving/calibration/v2.json"
    assert rendered.kv_calibration == "calibrated global scales from ConfigMap c"


def test_changing_the_reference_rolls_the_workers() -> None:
    a = _render("triaxial", calibration={"configMap": "cal-v1"})
    b = _render("triaxial", calibration={"configMap": "cal-v2"})
    pods = [_objects(r)["Deployment/qwen3-triaxial-decode"]["spec"]["template"] for r in (a, b)]
    assert pods[0] != pods[1]


@pytest.mark.parametrize(
    ("sample", "kv", "line"),
    [
        ("triaxial", {}, "default bits table for bitBudget 2.7 (no calibration ConfigMap)"),
        ("fp8_e4m3", {"globalScale": "static"}, "global scales 1.0"),
        ("fp8_e4m3", {"globalScale": "calibrated"}, "global scales measured at worker start (no calibration ConfigMap)"),
        (
            "fp8_e4m3",
            {"calibration": {"configMap": "c"}, "globalScale": "static"},
            "global scales 1.0 (ConfigMap c's scales unused: globalScale is static)",
        ),
    ],
)
def test_without_calibration_the_status_says_what_is_used(sample: str, kv: dict[str, Any], line: str) -> None:
    rendered = _render(sample, **kv)
    assert rendered.kv_calibration == line
    if "calibration" not in kv:
        assert _engine_config(rendered).kv_cache.calibration is None
        pods = [o for o in rendered.objects if o["kind"] == "Deployment"]
        assert all(v["name"] != "calibration" for p in pods for v in p["spec"]["template"]["spec"]["volumes"])
    desired = Desired(
        generation=1,
        replicas={"prefill": 1, "decode": 1, "gateway": 1},
        config_hash="h",
        endpoint="http://x",
        kv_bits=rendered.kv_bits,
        kv_calibration=rendered.kv_calibration,
    )
    status = compute_status(
        name="x", desired=desired, observed={}, observed_generation=None, previous={}, apply_error=None, now="2026-11-30T00:00:00Z"
    )
    assert status["kvCalibration"] == line


def test_bf16_refuses_a_calibration() -> None:
    body = apply_defaults(root_schema(), load_sample("fp8_e4m3"))
    body["spec"]["kvCache"].update(dtype="bf16", calibration={"configMap": "c"})
    with pytest.raises(ValueError, match="calibration needs dtype"):
        render(body["spec"], owner=Owner(name="x", namespace="d", uid=UID))
