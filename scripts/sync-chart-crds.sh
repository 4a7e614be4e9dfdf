#!/usr/bin/env bash
# Copy the generated CRDs (crds/*.yaml, from operator/api.py by `make crds`) into the Helm chart, so
# the chart installs exactly what the operator's schema says. tests/charts/test_chart.py checks the two
# folders are identical. kopf-peering.yaml is kopf's own CRD and lives only in the chart.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/crds"
DST="$ROOT/charts/modelfleet/crds"
KEEP="kopf-peering.yaml"

shopt -s nullglob
sources=("$SRC"/*.yaml)
if (( ${#sources[@]} == 0 )); then
  echo "sync-chart-crds: no CRDs in $SRC; generate them first with 'make crds'" >&2
  exit 1
fi

mkdir -p "$DST"
for stale in "$DST"/*.yaml; do
  name="$(basename "$stale")"
  if [[ "$name" != "$KEEP" && ! -f "$SRC/$name" ]]; then
    rm -f "$stale"
    echo "removed $DST/$name"
  fi
done
for src in "${sources[@]}"; do
  name="$(basename "$src")"
  if [[ "$name" == "$KEEP" ]]; then
    echo "sync-chart-crds: crds/$name would overwrite kopf's peering CRD in the chart; rename it" >&2
    exit 1
  fi
  if ! cmp -s "$src" "$DST/$name"; then
    cp "$src" "$DST/$name"
    echo "updated $DST/$name"
  fi
done
