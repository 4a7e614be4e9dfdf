{{/* Names: 63 characters at most, the DNS label limit. */}}
{{- define "modelfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "modelfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "modelfleet.operator.fullname" -}}
{{- printf "%s-operator" (include "modelfleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "modelfleet.controlPlane.fullname" -}}
{{- printf "%s-controlplane" (include "modelfleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "modelfleet.modelStore.claimName" -}}
{{- if .Values.modelStore.existingClaim }}
{{- .Values.modelStore.existingClaim }}
{{- else }}
{{- printf "%s-models" (include "modelfleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Cluster-scoped names (ClusterRoles, the peering object) carry the namespace: two releases of the
same name in different namespaces must not collide. */}}
{{- define "modelfleet.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "modelfleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "modelfleet.peeringName" -}}
{{- include "modelfleet.clusterName" . }}
{{- end }}

{{- define "modelfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "modelfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: modelfleet
{{- end }}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "operator"). */}}
{{- define "modelfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "modelfleet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "modelfleet.componentLabels" -}}
{{ include "modelfleet.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* repository[:tag][@digest]; call with (dict "image" .Values.images.x "ctx" $). */}}
{{- define "modelfleet.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag }}
{{- if .image.digest }}
{{- printf "%s:%s@%s" .image.repository $tag .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}


{{/* The container hardening every modelfleet container gets. */}}
{{- define "modelfleet.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: [ALL]
{{- end }}

{{- define "modelfleet.controlPlane.secretName" -}}
{{- if .Values.controlPlane.auth.existingSecret }}
{{- .Values.controlPlane.auth.existingSecret }}
{{- else }}
{{- printf "%s-auth" (include "modelfleet.controlPlane.fullname" .) }}
{{- end }}
{{- end }}

{{/* Fixed names of what the control plane writes in each tenant namespace (controlplane/resources.py:
KEYS_SECRET, QUOTA_NAME): its RBAC grants name them, and the operator mounts the Secret by this name. */}}
{{- define "modelfleet.apiKeysSecretName" -}}
modelfleet-api-keys
{{- end }}

{{- define "modelfleet.tenantQuotaName" -}}
modelfleet-quota
{{- end }}

{{- define "modelfleet.database.secretName" -}}
{{- if .Values.database.postgresql.existingSecret }}
{{- .Values.database.postgresql.existingSecret }}
{{- else }}
{{- printf "%s-database" (include "modelfleet.controlPlane.fullname" .) }}
{{- end }}
{{- end }}

{{- define "modelfleet.sqlite.claimName" -}}
{{- if .Values.database.sqlite.existingClaim }}
{{- .Values.database.sqlite.existingClaim }}
{{- else }}
{{- printf "%s-sqlite" (include "modelfleet.controlPlane.fullname" .) }}
{{- end }}
{{- end }}

{{/* Namespaces the operator's namespaced permissions apply in: empty list = cluster-wide. */}}
{{- define "modelfleet.operator.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

{{/* Egress every component needs: DNS and the API server, plus networkPolicy.extraEgress. */}}
{{- define "modelfleet.networkPolicy.baseEgress" -}}
# Name resolution.
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
# The Kubernetes API server (its address differs per cluster, so only the port is pinned).
- ports:
    {{- range .Values.networkPolicy.apiServerPorts }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
{{- with .Values.networkPolicy.extraEgress }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Schema migrations run in the hook Job (migrate-job.yaml) with PostgreSQL. SQLite keeps them in its
one replica: the Recreate strategy already makes it the only process that touches the file, and a Job
would need the ReadWriteOnce volume while the old pod still holds it (pre-upgrade), which hangs when the
two land on different nodes. */}}
{{- define "modelfleet.controlPlane.migrationJob" -}}
{{- if and .Values.controlPlane.enabled (eq .Values.database.type "postgresql") .Values.controlPlane.migrationJob.enabled }}true{{ end }}
{{- end }}

{{/* The control plane's environment, volume mounts and volumes: shared by its Deployment and its
migration Job so that the Job migrates exactly the database the replicas will use. */}}
{{- define "modelfleet.controlPlane.env" -}}
{{- $sqlite := eq .Values.database.type "sqlite" -}}
- name: MODELFLEET_CONTROLPLANE_ENVIRONMENT
  value: production
- name: MODELFLEET_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: MODELFLEET_CONTROLPLANE_HOST
  value: "0.0.0.0"
- name: MODELFLEET_CONTROLPLANE_PORT
  value: {{ .Values.controlPlane.port | quote }}
# Writes become CRs in the tenants' namespaces through the in-cluster service account.
- name: MODELFLEET_CONTROLPLANE_CLUSTER
  value: kubernetes
# SQLite: its one replica migrates at start. PostgreSQL: replicas never migrate; they answer 503 until
# the migration Job (or `modelfleet controlplane --migrate-only`, which ignores this) has run.
- name: MODELFLEET_CONTROLPLANE_MIGRATE_ON_START
  value: {{ $sqlite | quote }}
- name: MODELFLEET_CONTROLPLANE_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "modelfleet.controlPlane.secretName" . }}
      key: admin-key
- name: MODELFLEET_CONTROLPLANE_KEY_PEPPER
  valueFrom:
    secretKeyRef:
      name: {{ include "modelfleet.controlPlane.secretName" . }}
      key: key-pepper
{{- if $sqlite }}
- name: DATABASE_URL
  value: sqlite:////var/lib/modelfleet/controlplane.db
{{- else }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "modelfleet.database.secretName" . }}
      key: {{ .Values.database.postgresql.existingSecretKey }}
{{- end }}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_SERVICE_NAME
  value: modelfleet-controlplane
{{- end }}
{{- with .Values.controlPlane.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "modelfleet.controlPlane.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if eq .Values.database.type "sqlite" }}
- name: data
  mountPath: /var/lib/modelfleet
{{- end }}
{{- end }}

{{- define "modelfleet.controlPlane.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- if eq .Values.database.type "sqlite" }}
- name: data
  persistentVolumeClaim:
    claimName: {{ include "modelfleet.sqlite.claimName" . }}
{{- end }}
{{- end }}
