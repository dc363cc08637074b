#!/usr/bin/env bash
# Validates every Kubernetes manifest under deploy/ against the Kubernetes OpenAPI schema,
# strictly (a field the schema does not know fails, as a typo would be dropped by the API
# server without a word), for the oldest Kubernetes deploy/ supports (1.30: the gateway's
# preStop `sleep`) and the newest the validator ships. cert-manager's objects (CRDs, in no
# Kubernetes schema) are validated against a schema of the cert-manager v1 fields they use,
# written here, as strict. Envoy's files (bootstraps, SDS) are not Kubernetes objects and
# are skipped (tests/kubernetes/deploy_manifests.rs runs them through Envoy), as are the
# kustomizations (the same test renders them with `kubectl kustomize`).
#
#   bash scripts/validate-deploy.sh [FILE...]     (default: every YAML file under deploy/)
#   bash scripts/validate-deploy.sh --install-only  (the validator only, then stop)
#
# With no FILE, ray-xds's own config (the ConfigMap ray-xds-config) is checked too, by
# `ray-xds check --offline` (its TLS files exist only in the pod): the binary is
# $RAY_XDS_BIN, or target/debug/ray-xds, built if it is missing.
#
# Needs PyPI once: kubernetes-validate (with its bundled schemas, so nothing else is
# fetched) goes into .venv-validate/. A self-check first makes sure strictness still bites.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-validate"
want=1.37.0
versions=(1.30.0 1.37.0)

mkdir -p "$venv"
# Nothing in the venv belongs in git.
[ -f "$venv/.gitignore" ] || echo '*' >"$venv/.gitignore"
exec 9>"$venv/.install.lock"
flock 9
if ! "$venv/bin/python" -c "import kubernetes_validate.version as v, sys; sys.exit(v.__version__ != '$want')" 2>/dev/null; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$want" >&2
fi
flock -u 9
[ "${1:-}" != --install-only ] || exit 0

cd "$root"
if [ $# -eq 0 ]; then
    mapfile -t files < <(find deploy -name '*.yaml' -o -name '*.yml' | sort)
    bin=${RAY_XDS_BIN:-$root/target/debug/ray-xds}
    [ -x "$bin" ] || cargo build --quiet --bin ray-xds
    config=$(mktemp --suffix=.yaml)
    trap 'rm -f "$config"' EXIT
    "$venv/bin/python" -c 'import sys, yaml; sys.stdout.write(yaml.safe_load(open(sys.argv[1]))["data"]["ray-xds.yaml"])' \
        deploy/ray-xds-config.yaml >"$config"
    echo "deploy/ray-xds-config.yaml (ray-xds.yaml): ray-xds check --offline"
    "$bin" check --offline --config "$config" | sed 's/^/  /'
    rm -f "$config"
else
    files=("$@")
fi
exec "$venv/bin/python" - "${versions[*]}" "${files[@]}" <<'EOF'
import sys

import jsonschema
import kubernetes_validate
import yaml

versions = sys.argv[1].split()
files = sys.argv[2:]

# cert-manager v1 (cert-manager.io/v1), the fields deploy/ uses and their neighbours; the
# rules the CRD and its webhook add (required fields, one issuer type, known usages).
NAMES = ["commonName", "dnsNames", "uris", "emailAddresses", "ipAddresses", "otherNames",
         "literalSubject"]
USAGES = ["signing", "digital signature", "content commitment", "key encipherment",
          "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
          "decipher only", "any", "server auth", "client auth", "code signing",
          "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "timestamping"]
DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s|ms))+$"}
METADATA = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "namespace": {"type": "string", "minLength": 1},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
STRINGS = {"type": "array", "items": {"type": "string"}}
CERTIFICATE = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": {**METADATA, "required": ["name", "namespace"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["secretName", "issuerRef"],
            "anyOf": [{"required": [n]} for n in NAMES],
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "issuerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                        "group": {"type": "string"},
                    },
                },
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": STRINGS, "uris": STRINGS, "emailAddresses": STRINGS,
                "ipAddresses": STRINGS,
                "isCA": {"type": "boolean"},
                "duration": DURATION, "renewBefore": DURATION,
                "usages": {"type": "array", "items": {"enum": USAGES}},
                "privateKey": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                        "size": {"type": "integer"},
                    },
                },
            },
        },
    },
}
ISSUER_SPEC = {
    "type": "object", "additionalProperties": False,
    "minProperties": 1, "maxProperties": 1,
    "properties": {
        "selfSigned": {
            "type": "object", "additionalProperties": False,
            "properties": {"crlDistributionPoints": STRINGS},
        },
        "ca": {
            "type": "object", "additionalProperties": False, "required": ["secretName"],
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "crlDistributionPoints": STRINGS, "ocspServers": STRINGS,
                "issuingCertificateURLs": STRINGS,
            },
        },
    },
}
def issuer(kind, namespaced):
    return {
        "type": "object", "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": kind},
            "metadata": {**METADATA, "required": ["name", "namespace"]} if namespaced
            else {**METADATA, "not": {"required": ["namespace"]}},
            "spec": ISSUER_SPEC,
        },
    }
CERT_MANAGER = {
    "Certificate": CERTIFICATE,
    "Issuer": issuer("Issuer", True),
    "ClusterIssuer": issuer("ClusterIssuer", False),
}

# KubeRay's RayService (the CRD of KubeRay 1.7, tests/fixtures/), for the examples in
# deploy/ray/: the CRD's own schema, and each pod template as Kubernetes' PodTemplate
# (strict), which the CRD leaves open.
with open("tests/fixtures/kuberay-1.7/ray.io_rayservices.yaml") as f:
    crd = yaml.safe_load(f)
RAYSERVICE = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]
                  if v["name"] == "v1")

def rayservice_templates(doc):
    cluster = doc.get("spec", {}).get("rayClusterConfig", {})
    yield "headGroupSpec.template", cluster.get("headGroupSpec", {}).get("template")
    for i, group in enumerate(cluster.get("workerGroupSpecs", [])):
        yield f"workerGroupSpecs.{i}.template", group.get("template")

def check(doc, origin):
    """Problems with one document, or None when it is not to be checked here."""
    api, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    if not api or not kind or kind == "Kustomization":
        return None
    problems = []
    if api == "ray.io/v1" and kind == "RayService":
        for e in jsonschema.Draft202012Validator(RAYSERVICE).iter_errors(doc):
            path = ".".join(str(p) for p in e.absolute_path) or "(top)"
            problems.append(f"KubeRay 1.7 RayService: {path}: {e.message}")
        for where, template in rayservice_templates(doc):
            if template is None:
                problems.append(f"{where}: missing")
                continue
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": "t"}, "template": template}
            for p in check(wrapped, origin) or []:
                problems.append(f"{where}: {p}")
        return problems
    if api.startswith("cert-manager.io/"):
        schema = CERT_MANAGER.get(kind)
        if schema is None:
            return [f"{kind}: no cert-manager schema here"]
        validator = jsonschema.Draft202012Validator(schema)
        for e in validator.iter_errors(doc):
            path = ".".join(str(p) for p in e.absolute_path) or "(top)"
            problems.append(f"cert-manager v1: {path}: {e.message}")
        return problems
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"Kubernetes {version}: no schema for {api} {kind}")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(top)"
            problems.append(f"Kubernetes {version}: {path}: {e.message}")
    return problems

# Strictness still bites: a misspelt field fails, in both kinds of schema.
typo = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
        "spec": {"ports": [{"port": 80, "targtPort": 80}]}}
cm_typo = {"apiVersion": "cert-manager.io/v1", "kind": "Certificate",
           "metadata": {"name": "c", "namespace": "n"},
           "spec": {"secretName": "s", "issuerRef": {"name": "i"}, "dnsName": ["x"]}}
assert check(typo, "self-check"), "kubernetes-validate no longer rejects unknown fields"
assert check(cm_typo, "self-check"), "the cert-manager schema no longer rejects unknown fields"
rs_typo = {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "r"},
           "spec": {"rayClusterConfig": {"headGroupSpec": {"rayStartParams": {}, "template": {
               "spec": {"containers": [{"name": "c", "image": "i", "lifecyle": {}}]}}}}}}
assert check(rs_typo, "self-check"), "a RayService's pod template is no longer checked strictly"

failed = checked = 0
skipped = []
for path in files:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    file_checked = False
    for i, doc in enumerate(docs):
        origin = f"{path}#{i}"
        problems = check(doc, origin) if isinstance(doc, dict) else None
        if problems is None:
            continue
        file_checked = True
        checked += 1
        name = f"{doc['kind']} {doc.get('metadata', {}).get('name', '?')}"
        if problems:
            failed += 1
            for p in problems:
                print(f"FAIL {origin} {name}: {p}")
        else:
            print(f"ok   {origin} {name}")
    if not file_checked:
        skipped.append(path)
for path in skipped:
    print(f"skip {path} (not a Kubernetes object: Envoy's file, a kustomization or Prometheus rules)")
print(f"validate-deploy: {checked} objects against Kubernetes {' and '.join(versions)} "
      f"(strict), cert-manager v1 and KubeRay 1.7: {checked - failed} passed, {failed} failed")
if checked == 0:
    sys.exit("validate-deploy: nothing was checked")
sys.exit(1 if failed else 0)
EOF
