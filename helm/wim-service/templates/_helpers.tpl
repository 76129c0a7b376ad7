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

{{/* The release's Ray pods (head and workers), for NetworkPolicy selectors. */}}
{{- define "wim-service.rayPodSelector" -}}
matchLabels:
  {{- include "wim-service.selectorLabels" . | nindent 2 }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [ray-head, ray-worker]
{{- end }}

{{/* The KubeRay operator's pods, as a NetworkPolicyPeer. */}}
{{- define "wim-service.operatorPeer" -}}
- namespaceSelector:
    {{- toYaml .Values.networkPolicy.kuberayOperator.namespaceSelector | nindent 4 }}
  podSelector:
    {{- toYaml .Values.networkPolicy.kuberayOperator.podSelector | nindent 4 }}
{{- end }}

{{/* Ray ports the chart names more than once (Ray's defaults). */}}
{{- define "wim-service.dashboardPort" -}}8265{{- end }}
{{- define "wim-service.rayMetricsPort" -}}8080{{- end }}

{{/*
Ray custom resources that place the replicas: each EngineReplica asks for one wim_engine_host,
offered only by the engines group; each WiMRouter for one wim_router_host, offered only by the
routers group (router.workerGroup). deploy/serve_config_multinode.yaml uses the same names.
*/}}
{{- define "wim-service.engineHost" -}}wim_engine_host{{- end }}
{{- define "wim-service.routerHost" -}}wim_router_host{{- end }}

{{/* The Secret with Ray's token (key auth_token). */}}
{{- define "wim-service.rayTokenSecret" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-token" (include "wim-service.fullname" .)) }}
{{- end }}

{{/* Where the API keys Secret is mounted; the service reads $WIM_API_KEYS_FILE. */}}
{{- define "wim-service.keysDir" -}}/etc/wim/keys{{- end }}

{{/* Refuse values that would deploy an open or inconsistent service. */}}
{{- define "wim-service.checks" -}}
{{- if and .Values.auth.existingSecret .Values.auth.allowOpen }}
{{- fail "auth.existingSecret and auth.allowOpen are both set: choose API keys or an open service" }}
{{- end }}
{{- if not (or .Values.auth.existingSecret .Values.auth.allowOpen) }}
{{- fail "auth.existingSecret is empty: create a Secret with the API keys file keys.json (docs/deploy.md) and set auth.existingSecret to its name, or set auth.allowOpen=true to run without keys" }}
{{- end }}
{{- $redis := eq .Values.store.backend "redis" }}
{{- if and (gt (int .Values.router.replicas) 1) (not $redis) }}
{{- fail (printf "router.replicas=%v needs store.backend=redis: with the memory store each router would hold its own document sessions" .Values.router.replicas) }}
{{- end }}
{{- if and $redis (not .Values.store.redis.urlSecret.name) }}
{{- fail "store.backend=redis needs store.redis.urlSecret.name: a Secret whose key holds the Redis URL" }}
{{- end }}
{{- if and .Values.store.encryptionKeySecret.name (not $redis) }}
{{- fail "store.encryptionKeySecret encrypts documents stored in Redis: it needs store.backend=redis" }}
{{- end }}
{{- /* Replicas that no pod can ever hold would stay pending without a word. */}}
{{- $engines := .Values.serve.application.deployments.EngineReplica.autoscaling_config | default dict }}
{{- $engineRoom := mul .Values.worker.maxReplicas .Values.worker.enginesPerPod }}
{{- if gt (int ($engines.max_replicas | default 0)) (int $engineRoom) }}
{{- fail (printf "EngineReplica autoscaling_config.max_replicas=%v exceeds worker.maxReplicas x worker.enginesPerPod=%v: the engines beyond would never start" $engines.max_replicas $engineRoom) }}
{{- end }}
{{- with .Values.router.workerGroup }}
{{- if .enabled }}
{{- $routerRoom := mul .maxReplicas .routersPerPod }}
{{- if gt (int $.Values.router.replicas) (int $routerRoom) }}
{{- fail (printf "router.replicas=%v exceeds router.workerGroup.maxReplicas x routersPerPod=%v: the routers beyond would never start" $.Values.router.replicas $routerRoom) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.gcsFaultTolerance.enabled (not .Values.gcsFaultTolerance.redisAddress) }}
{{- fail "gcsFaultTolerance.enabled needs gcsFaultTolerance.redisAddress (host:port)" }}
{{- end }}
{{- include "wim-service.kvStoreChecks" . }}
{{- end }}

{{/*
Stored document KV (kvStore): one backend and a master key. The store is named in the
environment only: the routers read it there (they delete a session's stored KV), and a Redis
URL belongs in a Secret, so the engine's own kv_store options are refused in the serve config.
*/}}
{{- define "wim-service.kvStoreChecks" -}}
{{- $engine := .Values.serve.application.args.engine | default dict }}
{{- range $option := list "kv_store" "kv_store_max_gib" }}
{{- if hasKey $engine $option }}
{{- fail (printf "serve.application.args.engine.%s: set kvStore.* instead (the routers read the KV store from the environment, and a Redis URL belongs in a Secret)" $option) }}
{{- end }}
{{- end }}
{{- with .Values.kvStore }}
{{- if .enabled }}
{{- if not .masterKeySecret.name }}
{{- fail "kvStore.enabled needs kvStore.masterKeySecret.name: a Secret whose key holds base64 of 32 random bytes (stored KV is customer data and is never written in clear)" }}
{{- end }}
{{- if and .redisUrlSecret.name .volume.claimName }}
{{- fail "kvStore.redisUrlSecret and kvStore.volume are both set: choose one backend for the KV store" }}
{{- end }}
{{- if not (or .redisUrlSecret.name .volume.claimName) }}
{{- fail "kvStore.enabled needs a backend: kvStore.redisUrlSecret.name (a Secret whose key holds a redis:// URL) or kvStore.volume.claimName (a ReadWriteMany PersistentVolumeClaim)" }}
{{- end }}
{{- $path := .volume.mountPath }}
{{- range $taken := list "/tmp" "/home/ray" "/dev/shm" (include "wim-service.keysDir" $) }}
{{- if and $.Values.kvStore.volume.claimName (or (eq $path $taken) (hasPrefix (printf "%s/" $taken) $path)) }}
{{- fail (printf "kvStore.volume.mountPath=%s is inside %s, which the chart mounts already: choose a path of its own" $path $taken) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when the KV store lives on the shared volume (kvStore.volume), else empty. */}}
{{- define "wim-service.kvVolume" -}}
{{- if and .Values.kvStore.enabled .Values.kvStore.volume.claimName }}true{{- end }}
{{- end }}

{{/* "true" when the KV store is a Redis (kvStore.redisUrlSecret), else empty. */}}
{{- define "wim-service.kvRedis" -}}
{{- if and .Values.kvStore.enabled .Values.kvStore.redisUrlSecret.name }}true{{- end }}
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
deployment name into Serve's list of {name, ...}, WiMRouter's num_replicas from
router.replicas, args.router.store.backend from store.backend, and the placement resources
(wim-service.engineHost, and wim-service.routerHost with router.workerGroup.enabled) in
ray_actor_options.resources.
*/}}
{{- define "wim-service.serveConfig" -}}
{{- $app := omit (deepCopy .Values.serve.application) "deployments" }}
{{- /* store.backend picks the backend; args.router.store may add StoreConfig options. The URL
       and the encryption key stay in the environment (Secrets), never in the config. */}}
{{- $store := $app.args.router.store | default dict }}
{{- if or $store (eq .Values.store.backend "redis") }}
{{- $_ := set $store "backend" .Values.store.backend }}
{{- $_ := set $app.args.router "store" $store }}
{{- end }}
{{- $deployments := list }}
{{- range $name, $options := .Values.serve.application.deployments }}
{{- $fixed := dict "name" $name }}
{{- $host := "" }}
{{- if eq $name "WiMRouter" }}
{{- $_ := set $fixed "num_replicas" (int $.Values.router.replicas) }}
{{- if $.Values.router.workerGroup.enabled }}
{{- $host = include "wim-service.routerHost" $ }}
{{- end }}
{{- else if eq $name "EngineReplica" }}
{{- $host = include "wim-service.engineHost" $ }}
{{- end }}
{{- if $host }}
{{- $_ := set $fixed "ray_actor_options" (dict "resources" (dict $host 1)) }}
{{- end }}
{{- /* merge keeps $fixed's keys and adds the values' (ray_actor_options key by key). */}}
{{- $deployments = append $deployments (merge $fixed $options) }}
{{- end }}
{{- $_ := set $app "deployments" $deployments }}
{{- $config := omit .Values.serve "application" }}
{{- $_ := set $config "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}

{{/*
The service's environment on every Ray container (head and workers: Serve may place a router
replica on either). Secrets are referenced, never copied into the manifest.
*/}}
{{- define "wim-service.serviceEnv" -}}
{{- if .Values.auth.existingSecret }}
- name: WIM_API_KEYS_FILE
  value: {{ include "wim-service.keysDir" . }}/keys.json
{{- else }}
- name: WIM_ALLOW_OPEN
  value: "1"
{{- end }}
{{- if eq .Values.store.backend "redis" }}
- name: WIM_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.store.redis.urlSecret.name }}
      key: {{ .Values.store.redis.urlSecret.key }}
{{- with .Values.store.encryptionKeySecret }}
{{- if .name }}
- name: WIM_STORE_ENCRYPTION_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.kvStore }}
{{- if .enabled }}
{{- /* Engines save and restore documents' KV; routers delete it and measure the store. */}}
- name: WIM_KV_STORE
  {{- if .redisUrlSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .redisUrlSecret.name }}
      key: {{ .redisUrlSecret.key }}
  {{- else }}
  value: {{ .volume.mountPath | quote }}
  {{- end }}
- name: WIM_KV_MASTER_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .masterKeySecret.name }}
      key: {{ .masterKeySecret.key }}
- name: WIM_KV_STORE_MAX_GIB
  value: {{ .maxGiB | quote }}
- name: WIM_KV_STORE_MAX_AGE_H
  value: {{ .maxAgeHours | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
One worker group: dict "root" $ "group" <worker | router.workerGroup values> "resource" <the
Ray custom resource its pods offer> "count" <how many per pod>. The group's `resources`
(KubeRay >= 1.5) becomes `ray start --resources` on each pod, and Ray's autoscaler reads it as
what a new pod of the group would offer, so it adds pods of the right group.
*/}}
{{- define "wim-service.workerGroup" -}}
{{- $group := .group -}}
- groupName: {{ $group.groupName }}
  replicas: {{ $group.replicas }}
  minReplicas: {{ $group.minReplicas }}
  maxReplicas: {{ $group.maxReplicas }}
  resources:
    {{ .resource }}: {{ .count | quote }}
  rayStartParams:
    {{- toYaml $group.rayStartParams | nindent 4 }}
  template:
    {{- $ports := list (dict "name" "serve" "containerPort" (int .root.Values.serve.http_options.port)) }}
    {{- include "wim-service.podTemplate" (dict "root" .root "group" $group "name" "ray-worker" "component" "ray-worker" "ports" $ports "serviceAccountToken" false) | nindent 4 }}
{{- end }}

{{/* Writable scratch mounts under the read-only root (Ray container and autoscaler). */}}
{{- define "wim-service.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/ray
{{- end }}

{{/*
One Ray container and its pod: head or worker. Called with
dict "root" $ "group" <head|worker values> "name" <container name> "ports" <list>
"serviceAccountToken" <bool: the autoscaler on the head calls the Kubernetes API>.
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
  automountServiceAccountToken: {{ .serviceAccountToken }}
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
        # Ray's connections ping their peer every 5 s and fail their calls after 5 s without
        # an answer: a request already sent to a router on a node cut off the network is cut
        # (and retried by its client) within seconds, not minutes (docs/deploy.md, "Deadlines").
        - name: RAY_grpc_client_keepalive_time_ms
          value: "5000"
        - name: RAY_grpc_client_keepalive_timeout_ms
          value: "5000"
        {{- include "wim-service.serviceEnv" $root | trim | nindent 8 }}
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
        {{- include "wim-service.scratchMounts" $root | nindent 8 }}
        {{- if $root.Values.auth.existingSecret }}
        - name: api-keys
          mountPath: {{ include "wim-service.keysDir" $root }}
          readOnly: true
        {{- end }}
        {{- if include "wim-service.kvVolume" $root }}
        # The KV store, shared by every Ray pod of the release.
        - name: kv-store
          mountPath: {{ $root.Values.kvStore.volume.mountPath }}
        {{- end }}
  volumes:
    # Ray's object store and vLLM's shared-memory queues.
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $group.shmSize }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ $root.Values.scratch.tmpSize }}
    - name: home
      emptyDir:
        sizeLimit: {{ $root.Values.scratch.homeSize }}
    {{- with $root.Values.auth.existingSecret }}
    - name: api-keys
      secret:
        secretName: {{ . }}
        items:
          - key: keys.json
            path: keys.json
        # Readable by the pod's group (fsGroup) only.
        defaultMode: 0440
    {{- end }}
    {{- if include "wim-service.kvVolume" $root }}
    - name: kv-store
      persistentVolumeClaim:
        claimName: {{ $root.Values.kvStore.volume.claimName }}
    {{- end }}
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
