{{/* Names, labels, and the pieces every specserve pod shares. */}}

{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "specserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "specserve.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router") */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Indent a helper's output by `indent`, or emit nothing when it is empty.
     (dict "indent" 12 "text" (include "specserve.modelsMount" .)) */}}
{{- define "specserve.block" -}}
{{- with (.text | trim) -}}
{{- . | nindent $.indent -}}
{{- end -}}
{{- end -}}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image reference: (dict "ctx" $ "image" .Values.images.router) */}}
{{- define "specserve.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "specserve.svcHost" -}}
{{- printf "%s.%s.svc.%s" .name .ctx.Release.Namespace .ctx.Values.clusterDomain -}}
{{- end -}}

{{- define "specserve.draftName" -}}
{{- printf "%s-draft-%s" (include "specserve.fullname" .ctx) .pool.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specserve.rayClusterName" -}}
{{- printf "%s-target" (include "specserve.fullname" .) -}}
{{- end -}}

{{/* A setting's value as the string pydantic-settings parses: maps and lists as JSON,
     whole numbers without an exponent (Helm reads YAML numbers as float64). */}}
{{- define "specserve.settingValue" -}}
{{- if or (kindIs "map" .) (kindIs "slice" .) -}}
{{- toJson . -}}
{{- else if and (kindIs "float64" .) (eq (. | int64 | float64) .) -}}
{{- . | int64 -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* env entries for a settings map: (dict "prefix" "SPECSERVE_ROUTER_" "settings" $map) */}}
{{- define "specserve.settingsEnv" -}}
{{- range $key := keys .settings | sortAlpha }}
- name: {{ printf "%s%s" $.prefix (upper $key) }}
  value: {{ include "specserve.settingValue" (get $.settings $key) | quote }}
{{- end }}
{{- end -}}

{{/* Downward API: who and where this pod is (POD_IP first: later values expand $(POD_IP)). */}}
{{- define "specserve.podEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}

{{/* Tracing: SPECSERVE_TRACING and the standard OpenTelemetry variables. Each service names
     itself (OTEL_SERVICE_NAME is left to the code); the target launcher hands these on to its
     actor's runtime_env. (dict "ctx" $) */}}
{{- define "specserve.otelEnv" -}}
{{- $t := .ctx.Values.tracing -}}
{{- if $t.enabled }}
- name: SPECSERVE_TRACING
  value: otlp
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $t.otlpEndpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $t.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $t.samplerArg | toString | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)"
{{- end }}
{{- end -}}

{{/* Hugging Face cache and hub access for pods that load models. */}}
{{- define "specserve.hfEnv" -}}
- name: HF_HOME
  value: /var/cache/huggingface
- name: HF_HUB_OFFLINE
  value: {{ ternary "1" "0" .Values.models.hubOffline | quote }}
{{- if .Values.models.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.models.hfTokenSecret.name }}
      key: {{ .Values.models.hfTokenSecret.key }}
{{- end }}
{{- end -}}

{{- define "specserve.modelsVolume" -}}
{{- if .Values.models.volume }}
- name: models
  {{- toYaml .Values.models.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "specserve.modelsMount" -}}
{{- if .Values.models.volume }}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* gRPC probes on grpc.health.v1: startup and readiness ask for the service by name,
     liveness for the server as a whole (""). (dict "ctx" $ "port" 50051 "service" "specserve.v1.Generation") */}}
{{- /* TLS on every hop (ADR 0011): the Secret (tls.crt, tls.key, ca.crt) mounted read-only. */ -}}
{{- define "specserve.tlsEnv" -}}
{{- if .ctx.Values.tls.enabled }}
- name: {{ .name }}
  value: /etc/specserve/tls
{{- end }}
{{- end -}}

{{- define "specserve.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/specserve/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "specserve.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName | quote }}
{{- end }}
{{- end -}}

{{- /* The kubelet's gRPC probe speaks no TLS: with TLS on, the probes are TCP connects. */ -}}
{{- define "specserve.probeCheck" -}}
{{- if .ctx.Values.tls.enabled }}
tcpSocket:
  port: {{ .port }}
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
{{- end }}
{{- end -}}

{{- define "specserve.grpcProbes" -}}
{{- $p := .ctx.Values.probes -}}
startupProbe:
  {{- include "specserve.probeCheck" . | nindent 2 }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
readinessProbe:
  {{- if .readinessHttp }}
  httpGet:
    path: /health
    port: {{ .readinessHttp }}
  {{- else }}
  {{- include "specserve.probeCheck" . | nindent 2 }}
  {{- end }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
livenessProbe:
  {{- include "specserve.probeCheck" (dict "ctx" .ctx "port" .port "service" "") | nindent 2 }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ default $p.liveness.failureThreshold .livenessFailureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
{{- end -}}

{{/* preStop sleep, then SIGTERM starts the service's own drain (settings.grace_s). */}}
{{- /* Ray's token authentication (Ray >= 2.52): every Ray process and client of the cluster
       needs the token, from a Secret (key `token`). */ -}}
{{- define "specserve.rayAuthSecret" -}}
{{- default (printf "%s-ray-token" (include "specserve.fullname" .)) .Values.target.rayAuth.existingSecret -}}
{{- end -}}

{{- define "specserve.rayAuthEnv" -}}
{{- if .Values.target.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "specserve.rayAuthSecret" . | quote }}
      key: token
{{- end }}
{{- end -}}

{{- /* Egress every specserve pod needs: DNS, the OTLP collector, and the cluster's extras. */ -}}
{{- define "specserve.egressDns" -}}
- to:
    - namespaceSelector: {}
  ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end -}}

{{- define "specserve.egressCommon" -}}
{{- $e := .Values.networkPolicy.egress -}}
{{ include "specserve.egressDns" . }}
{{- if .Values.tracing.enabled }}
- ports:
    - port: {{ $e.otlpPort }}
      protocol: TCP
  {{- with $e.otlp }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- with $e.extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "specserve.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.preStopSleepSeconds | toString | quote }}]
{{- end -}}

{{/* terminationGracePeriodSeconds longer than preStop + drain: (dict "ctx" $ "grace" 10) */}}
{{- define "specserve.terminationGrace" -}}
{{- add (int .ctx.Values.preStopSleepSeconds) (int (ceil .grace)) (int .ctx.Values.terminationGraceMarginSeconds) -}}
{{- end -}}

{{/* Soft anti-affinity over nodes unless the user gave an affinity.
     (dict "ctx" $ "affinity" {...} "labels" "<selector labels yaml>") */}}
{{- define "specserve.affinity" -}}
{{- if .affinity }}
affinity:
  {{- toYaml .affinity | nindent 2 }}
{{- else }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- .labels | nindent 14 }}
{{- end }}
{{- end -}}

{{/* Draft pools with the chart-level defaults applied; fails on duplicate names. Returns
     YAML: {pools: [...]} (use fromYaml). */}}
{{- define "specserve.draftPools" -}}
{{- $seen := dict -}}
{{- $out := list -}}
{{- range $p := .Values.draft.pools -}}
{{- if hasKey $seen $p.name -}}
{{- fail (printf "draft.pools: pool name %q is used twice" $p.name) -}}
{{- end -}}
{{- $_ := set $seen $p.name true -}}
{{- if and $p.inTarget (not (has ($p.model | toString) (list "ngram" "eagle" "suffix"))) (not (hasPrefix "/" ($p.model | toString))) -}}
{{- fail (printf "draft.pools %q: inTarget needs model \"ngram\", \"eagle\", \"suffix\" or a draft model's directory (an absolute path under models.mountPath: local:draft, ADR 0025), got %q" $p.name ($p.model | toString)) -}}
{{- end -}}
{{- if and (eq ($p.model | toString) "suffix") (not $p.inTarget) -}}
{{- fail (printf "draft.pools %q: a suffix pool is drafted inside the target only (inTarget: true; ADR 0026)" $p.name) -}}
{{- end -}}
{{- if and (eq ($p.model | toString) "eagle") (not $p.inTarget) (not (and ($p.settings | default dict).eagle_head ($p.settings | default dict).eagle_target)) -}}
{{- fail (printf "draft.pools %q: a remote eagle pool needs settings.eagle_head and settings.eagle_target (directories under models.mountPath)" $p.name) -}}
{{- end -}}
{{- $pool := deepCopy $p -}}
{{- $_ := set $pool "settings" (mergeOverwrite (deepCopy ($.Values.draft.settings | default dict)) ($p.settings | default dict)) -}}
{{- $gpu := int ($p.gpu | default 0) -}}
{{- $_ := set $pool "gpu" $gpu -}}
{{- include "specserve.deviceAgrees" (dict "what" (printf "draft.pools %q" $p.name) "gpu" $gpu "device" ($pool.settings.device | default "auto")) -}}
{{- if not (hasKey $p "nodeSelector") -}}
{{- $_ := set $pool "nodeSelector" (ternary $.Values.draft.gpuNodeSelector (dict) (gt $gpu 0)) -}}
{{- end -}}
{{- if not (hasKey $p "tolerations") -}}
{{- $_ := set $pool "tolerations" (ternary $.Values.draft.gpuTolerations (list) (gt $gpu 0)) -}}
{{- end -}}
{{- if not (hasKey $p "pdb") -}}
{{- $_ := set $pool "pdb" $.Values.draft.pdb -}}
{{- end -}}
{{- $out = append $out $pool -}}
{{- end -}}
{{- if not (hasKey $seen .Values.router.defaultPool) -}}
{{- fail (printf "router.defaultPool %q is not one of draft.pools (%s)" .Values.router.defaultPool (keys $seen | sortAlpha | join ", ")) -}}
{{- end -}}
{{- toYaml (dict "pools" $out) -}}
{{- end -}}

{{/* SPECSERVE_ROUTER_DRAFT_POOLS: pool -> [its headless Service's DNS name:port], or
     ["local:<model>"] (local:ngram, local:eagle, local:suffix; local:draft for a model
     directory) for a pool drafted inside the target (inTarget: no Deployment) */}}
{{/* SPECSERVE_TARGET_EAGLE_POOLS: the remote pools whose replicas draft with an EAGLE head
     (model "eagle", not inTarget): the target sends them its features (ADR 0020) */}}
{{- define "specserve.eaglePoolsJson" -}}
{{- $out := list -}}
{{- range $p := (include "specserve.draftPools" . | fromYaml).pools -}}
{{- if and (eq ($p.model | toString) "eagle") (not $p.inTarget) -}}
{{- $out = append $out $p.name -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* SPECSERVE_TARGET_LOCAL_DRAFT_MODEL: the directory of the inTarget pools with a model
     directory (local:draft, ADR 0025); one directory a chart; empty: none */}}
{{- define "specserve.localDraftModel" -}}
{{- $dirs := list -}}
{{- range $p := (include "specserve.draftPools" . | fromYaml).pools -}}
{{- if and $p.inTarget (hasPrefix "/" ($p.model | toString)) -}}
{{- $dirs = append $dirs ($p.model | toString) | uniq -}}
{{- end -}}
{{- end -}}
{{- if gt (len $dirs) 1 -}}
{{- fail (printf "draft.pools: the target drafts inside itself with one draft model (local:draft), got %s" (join ", " $dirs)) -}}
{{- end -}}
{{- join "" $dirs -}}
{{- end -}}

{{- define "specserve.draftPoolsJson" -}}
{{- $m := dict -}}
{{- range $p := (include "specserve.draftPools" . | fromYaml).pools -}}
{{- if and $p.inTarget (hasPrefix "/" ($p.model | toString)) -}}
{{- $_ := set $m $p.name (list "local:draft") -}}
{{- else if $p.inTarget -}}
{{- $_ := set $m $p.name (list (printf "local:%s" ($p.model | toString))) -}}
{{- else -}}
{{- $host := include "specserve.svcHost" (dict "ctx" $ "name" (include "specserve.draftName" (dict "ctx" $ "pool" $p))) -}}
{{- $_ := set $m $p.name (list (printf "%s:%d" $host (int $.Values.draft.port))) -}}
{{- end -}}
{{- end -}}
{{- toJson $m -}}
{{- end -}}

{{/* A worker's GPU request and its `device` setting agree (ADR 0016): a pod without a GPU
     sees none, so `cuda` there cannot start; a GPU asked for and `cpu` set wastes it. `auto`
     follows the GPU. Fails the render; returns nothing. */}}
{{- define "specserve.deviceAgrees" -}}
{{- if and (hasPrefix "cuda" .device) (eq (int .gpu) 0) -}}
{{- fail (printf "%s: settings.device %q needs gpu >= 1 (without a GPU request the pod sees no GPU)" .what .device) -}}
{{- end -}}
{{- if and (eq .device "cpu") (gt (int .gpu) 0) -}}
{{- fail (printf "%s: gpu is %d but settings.device is \"cpu\": set device to auto or cuda, or gpu to 0" .what (int .gpu)) -}}
{{- end -}}
{{- end -}}
