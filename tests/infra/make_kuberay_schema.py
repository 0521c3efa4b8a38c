"""Regenerate ``kuberay_rayjob_schema.json`` (used by test_infra.py) from a KubeRay release.

The file is the ``ray.io/v1`` RayJob ``openAPIV3Schema`` of KubeRay's CRD
(``ray-operator/config/crd/bases/ray.io_rayjobs.yaml``, Apache-2.0) with every ``description``
removed to keep it small; its ``spec.rayClusterSpec`` part is also the RayCluster ``spec`` schema.
The vendored copy comes from the v1.6.0 tag, the oldest KubeRay whose ``authOptions`` has the
``secretName`` field the manifests use, so manifests that pass also apply on newer operators.

    python tests/infra/make_kuberay_schema.py path/to/ray.io_rayjobs.yaml v1.6.0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).with_name("kuberay_rayjob_schema.json")


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def main(crd_path: str, version: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text())
    if crd.get("kind") != "CustomResourceDefinition" or crd["spec"]["names"]["kind"] != "RayJob":
        raise SystemExit(f"{crd_path} is not the RayJob CRD")
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    doc = {
        "kuberay_version": version,
        "source": "ray-operator/config/crd/bases/ray.io_rayjobs.yaml",
        "schema": _strip(v1["schema"]["openAPIV3Schema"]),
    }
    OUT.write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
