{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "wim-service.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Release-qualified name. KubeRay derives "<name>-serve-svc" and "<name>-head-svc" from the
RayService name and appends a suffix to its RayCluster's name: keep it short (40 characters).
A release named like the start of the chart (`helm install wim`) is used as it is: wim-serve-svc.
*/}}
{{- define "wim-service.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if or (contains $name .Release.Name) (hasPrefix .Release.Name $name) }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Service KubeRay creates in front of every pod whose Serve proxy is healthy. */}}
{{- define "wim-service.serveService" -}}
{{- printf "%s-serve-svc" (include "wim-service.fullname" .) }}
{{- end }}

{{- define "wim-service.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "wim-service.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wim-service.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "wim-service.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "wim-service.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: wim-service
{{- end }}

{{/*
spec.serveConfigV2: values.serve with application.deployments turned from a map keyed by
deployment name into Serve's list of {name, ...}.
*/}}
{{- define "wim-service.serveConfig" -}}
{{- $app := omit .Values.serve.application "deployments" }}
{{- $deployments := list }}
{{- range $name, $options := .Values.serve.application.deployments }}
{{- $deployments = append $deployments (merge (dict "name" $name) $options) }}
{{- end }}
{{- $_ := set $app "deployments" $deployments }}
{{- $config := omit .Values.serve "application" }}
{{- $_ := set $config "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}

{{/*
One Ray container and its pod: head or worker. Called with
dict "root" $ "group" <head|worker values> "name" <container name> "ports" <list>.
*/}}
{{- define "wim-service.podTemplate" -}}
{{- $root := .root }}
{{- $group := .group -}}
metadata:
  labels:
    {{- include "wim-service.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
  {{- with $group.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  containers:
    - name: {{ .name }}
      image: {{ include "wim-service.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      env:
        - name: HF_HUB_OFFLINE
          value: "1"
        - name: TRANSFORMERS_OFFLINE
          value: "1"
        # Ray starts workers at nice 15 otherwise, and the engines inherit it.
        - name: RAY_worker_niceness
          value: "0"
        {{- with $root.Values.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .ports }}
      ports:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      resources:
        {{- toYaml $group.resources | nindent 8 }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $group.shmSize }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
