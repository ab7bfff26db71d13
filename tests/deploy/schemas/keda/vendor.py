"""Regenerates the KEDA schemas beside this file from KEDA's Go module, as the Go module proxy serves it:

    go mod download -json github.com/kedacore/keda/v2@v2.21.0    # prints "Dir": the module's source
    .venv/bin/python tests/deploy/schemas/keda/vendor.py <Dir>

- scaledobject.json, triggerauthentication.json: the openAPIV3Schema of the keda.sh/v1alpha1 CRDs
  (config/crd/bases/keda.sh_*.yaml), what the API server validates a ScaledObject against;
- kafka-trigger.json: the Kafka scaler's parameters (pkg/scalers/kafka_scaler.go, the `keda:"..."` tags of
  kafkaMetadata): name, where KEDA reads it (triggerMetadata, authParams, resolvedEnv), enum, required. The CRD
  types a trigger's metadata only as a map of strings; this is what KEDA itself checks at run time.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def crd_schema(module: Path, name: str) -> dict[str, object]:
    crd = yaml.safe_load((module / "config" / "crd" / "bases" / f"keda.sh_{name}.yaml").read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema: dict[str, object] = version["schema"]["openAPIV3Schema"]
    return schema


def kafka_parameters(module: Path) -> dict[str, dict[str, object]]:
    source = (module / "pkg" / "scalers" / "kafka_scaler.go").read_text()
    struct = source.split("type kafkaMetadata struct {", 1)[1].split("\n}", 1)[0]
    found: dict[str, dict[str, object]] = {}
    for tag in re.findall(r'`keda:"([^"]+)"`', struct):
        fields = dict(part.split("=", 1) if "=" in part else (part, "") for part in tag.split(","))
        found[fields["name"]] = {
            "from": fields["order"].split(";"),
            "required": "optional" not in fields and "default" not in fields,
            **({"enum": fields["enum"].split(";")} if "enum" in fields else {}),
        }
    return found


def main(module: Path) -> None:
    version = re.search(r"@(v[\d.]+)", str(module))
    for name, singular in (("scaledobjects", "scaledobject"), ("triggerauthentications", "triggerauthentication")):
        (HERE / f"{singular}.json").write_text(json.dumps(crd_schema(module, name), indent=1, sort_keys=True) + "\n")
    (HERE / "kafka-trigger.json").write_text(json.dumps(
        {"keda": version.group(1) if version else "unknown", "parameters": kafka_parameters(module)},
        indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
