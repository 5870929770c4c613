{{/* Names are cut to 63 characters (DNS labels); suffixes below stay short so they fit too. */}}
{{- define "moetune.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "moetune.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "moetune.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "moetune.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "moetune.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "moetune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "moetune.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moetune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "moetune.controlPlane.selectorLabels" -}}
{{ include "moetune.selectorLabels" . }}
app.kubernetes.io/component: control-plane
{{- end }}

{{- define "moetune.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "moetune.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "moetune.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "moetune.rayImage" -}}
{{- $repository := default .Values.image.repository .Values.ray.image.repository }}
{{- printf "%s:%s" $repository (default (printf "%s-cuda" .Chart.AppVersion) .Values.ray.image.tag) }}
{{- end }}

{{- define "moetune.rayClusterName" -}}
{{- printf "%s-ray" (include "moetune.fullname" .) }}
{{- end }}

{{/* KubeRay names the head's Service <RayCluster name>-head-svc. */}}
{{- define "moetune.rayAddress" -}}
{{- if .Values.ray.enabled }}
{{- printf "http://%s-head-svc.%s.svc:%v" (include "moetune.rayClusterName" .) .Release.Namespace .Values.ray.dashboardPort }}
{{- else }}
{{- .Values.ray.externalAddress }}
{{- end }}
{{- end }}

{{- define "moetune.callbackUrl" -}}
{{- default (printf "http://%s.%s.svc:%v" (include "moetune.fullname" .) .Release.Namespace .Values.controlPlane.service.port) .Values.controlPlane.callbackUrl }}
{{- end }}

{{/* Secret names: the user's own, or the one this chart renders. */}}
{{- define "moetune.apiTokensSecret" -}}
{{- default (printf "%s-api-tokens" (include "moetune.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "moetune.s3Secret" -}}
{{- default (printf "%s-s3" (include "moetune.fullname" .)) .Values.s3.existingSecret }}
{{- end }}

{{- define "moetune.s3HasKeys" -}}
{{- if or .Values.s3.existingSecret .Values.s3.accessKeyId }}true{{ end }}
{{- end }}

{{/* Static storage keys from their Secret: the control plane's and the Ray pods' (jobs inherit them from the
pod, so they never travel in a job's runtime_env, which Ray's dashboard shows). */}}
{{- define "moetune.s3KeyEnv" -}}
{{- if include "moetune.s3HasKeys" . }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ include "moetune.s3Secret" . }}
      key: {{ .Values.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "moetune.s3Secret" . }}
      key: {{ .Values.s3.secretAccessKeyKey }}
{{- end }}
{{- end }}

{{- define "moetune.databaseSecret" -}}
{{- default (printf "%s-database" (include "moetune.fullname" .)) .Values.database.existingSecret }}
{{- end }}

{{- define "moetune.postgresName" -}}
{{- printf "%s-postgres" (include "moetune.fullname" .) }}
{{- end }}

{{- define "moetune.rayAuthSecret" -}}
{{- default (printf "%s-ray-auth" (include "moetune.fullname" .)) .Values.ray.auth.existingSecret }}
{{- end }}

{{/* The value of `key` in an existing Secret `name` (so random defaults survive upgrades), else `default`. */}}
{{- define "moetune.keptSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .namespace .name }}
{{- if and $existing (index ($existing.data | default dict) .key) }}
{{- index $existing.data .key | b64dec }}
{{- else }}
{{- .default }}
{{- end }}
{{- end }}

{{/* Fails early on value combinations that cannot work. */}}
{{- define "moetune.checkValues" -}}
{{- $external := or .Values.database.url .Values.database.existingSecret }}
{{- if and $external .Values.database.bundled.enabled }}
{{- fail "database: set database.bundled.enabled=false when you give database.url or database.existingSecret" }}
{{- end }}
{{- if not (or $external .Values.database.bundled.enabled) }}
{{- fail "database: give database.url or database.existingSecret, or set database.bundled.enabled=true" }}
{{- end }}
{{- if and .Values.s3.accessKeyId (not .Values.s3.secretAccessKey) }}
{{- fail "s3: s3.accessKeyId needs s3.secretAccessKey" }}
{{- end }}
{{- if and (not .Values.ray.enabled) (not .Values.ray.externalAddress) }}
{{- fail "ray.externalAddress is required when ray.enabled=false (the Jobs API URL of your Ray cluster)" }}
{{- end }}
{{- if and (not .Values.ray.enabled) .Values.ray.auth.enabled (not (or .Values.ray.auth.token .Values.ray.auth.existingSecret)) }}
{{- fail "ray.auth: with an external Ray cluster, give its token (ray.auth.token or ray.auth.existingSecret)" }}
{{- end }}
{{- with .Values.controlPlane.schedulerLease }}
{{- if ge (float64 .renewSeconds) (float64 .leaseSeconds) }}
{{- fail "controlPlane.schedulerLease: renewSeconds must be below leaseSeconds (the lease would lapse between renewals)" }}
{{- end }}
{{- end }}
{{- if and .Values.ray.enabled (not .Values.ray.workerGroups) }}
{{- fail "ray.workerGroups: the RayCluster needs at least one worker group for training workers" }}
{{- end }}
{{- range .Values.ray.workerGroups }}
{{- if not (and (le (int .minReplicas) (int .replicas)) (le (int .replicas) (int .maxReplicas))) }}
{{- fail (printf "ray.workerGroups[%s]: need minReplicas <= replicas <= maxReplicas" .name) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Token auth for every Ray process and for the Jobs API client in the control plane. */}}
{{- define "moetune.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "moetune.rayAuthSecret" . }}
      key: {{ .Values.ray.auth.existingSecretKey }}
{{- end }}
{{- end }}

{{/* rayStartParams as a YAML map of strings; `{}` when empty (the CRD needs the field). */}}
{{- define "moetune.rayStartParams" -}}
{{- if . }}
{{- range $key, $value := . }}
{{ $key }}: {{ $value | quote }}
{{- end }}
{{- else }}
{}
{{- end }}
{{- end }}

{{/* Environment of every Ray container: token auth, the training workers' metrics port, ray.env. */}}
{{- define "moetune.rayEnv" -}}
{{- include "moetune.rayAuthEnv" . }}
{{- include "moetune.s3KeyEnv" . }}
- name: MOETUNE_METRICS_PORT
  value: {{ .Values.monitoring.rayPodMonitor.trainingPort | quote }}
{{- with .Values.ray.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod template of a Ray head or worker group: the moetune CUDA image, a memory-backed /dev/shm, Ray's token. */}}
{{- define "moetune.rayPodTemplate" -}}
{{- $root := .root }}
{{- $ray := $root.Values.ray }}
{{- $cacheGiB := int (default 0 .group.weightsCacheGiB) }}
metadata:
  labels:
    {{- include "moetune.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: ray-{{ .role }}
  {{- with .group.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $ray.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $ray.podSecurityContext | nindent 4 }}
  containers:
    - name: ray-{{ .role }}
      image: {{ include "moetune.rayImage" $root }}
      imagePullPolicy: {{ default $root.Values.image.pullPolicy $ray.image.pullPolicy }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      env: {{- include "moetune.rayEnv" $root | trim | nindent 8 }}
        {{- /* Off without a volume: the container's writable layer is no place for terabytes. The cap is 90 %
        of the volume in GB, so the cache evicts before the kubelet evicts the pod. */}}
        - name: MOETUNE_WEIGHTS_CACHE_DIR
          value: {{ if $cacheGiB }}/var/cache/moetune/weights{{ else }}""{{ end }}
        {{- if $cacheGiB }}
        - name: MOETUNE_WEIGHTS_CACHE_MAX_GB
          value: {{ div (mul $cacheGiB 966367641) 1000000000 | quote }}
        {{- end }}
      resources:
        {{- toYaml .group.resources | nindent 8 }}
      volumeMounts:
        - name: shm
          mountPath: /dev/shm
        {{- if $cacheGiB }}
        - name: weights-cache
          mountPath: /var/cache/moetune/weights
        {{- end }}
  volumes:
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .group.shmSize }}
    {{- if $cacheGiB }}
    - name: weights-cache
      emptyDir:
        sizeLimit: {{ $cacheGiB }}Gi
    {{- end }}
  {{- with .group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Where clients reach the Serve app: serve.publicUrl, else its in-cluster Service. */}}
{{- define "moetune.serveUrl" -}}
{{- .Values.serve.publicUrl | default (printf "http://%s-serve.%s.svc:%v" (include "moetune.fullname" .) .Release.Namespace .Values.serve.port) }}
{{- end }}
