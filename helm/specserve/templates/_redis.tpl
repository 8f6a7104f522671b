{{/* Redis: names, the services' URL per redis.mode (standalone | sentinel | cluster) and
     redis.source (bundled | external), and the checks the schema cannot make. */}}

{{- define "specserve.redisName" -}}
{{- printf "%s-redis" (include "specserve.fullname" .) -}}
{{- end -}}

{{/* sentinel and cluster modes: the data nodes' headless Service (stable pod DNS names) */}}
{{- define "specserve.redisHeadlessName" -}}
{{- printf "%s-redis-headless" (include "specserve.fullname" .) -}}
{{- end -}}

{{/* sentinel mode: the sentinels' StatefulSet and its headless Service */}}
{{- define "specserve.redisSentinelName" -}}
{{- printf "%s-redis-sentinel" (include "specserve.fullname" .) -}}
{{- end -}}

{{- define "specserve.redisSecretName" -}}
{{- default (include "specserve.redisName" .) .Values.redis.bundled.existingSecret -}}
{{- end -}}

{{- define "specserve.redisSentinelPort" -}}26379{{- end -}}

{{/* The DNS suffix of a data node: ".<headless>.<namespace>.svc.<clusterDomain>" */}}
{{- define "specserve.redisNodeSuffix" -}}
{{- printf ".%s" (include "specserve.svcHost" (dict "ctx" . "name" (include "specserve.redisHeadlessName" .))) -}}
{{- end -}}

{{- define "specserve.redisSentinelSuffix" -}}
{{- printf ".%s" (include "specserve.svcHost" (dict "ctx" . "name" (include "specserve.redisSentinelName" .))) -}}
{{- end -}}

{{/* Data node i's DNS name: (dict "ctx" $ "i" 0) */}}
{{- define "specserve.redisNodeHost" -}}
{{- printf "%s-%d%s" (include "specserve.redisName" .ctx) (int .i) (include "specserve.redisNodeSuffix" .ctx) -}}
{{- end -}}

{{- define "specserve.redisSentinelHost" -}}
{{- printf "%s-%d%s" (include "specserve.redisSentinelName" .ctx) (int .i) (include "specserve.redisSentinelSuffix" .ctx) -}}
{{- end -}}

{{/* host:port of every sentinel (bundled), space-separated */}}
{{- define "specserve.redisSentinelAddrs" -}}
{{- $out := list -}}
{{- range $i := until (int .Values.redis.bundled.sentinel.replicas) -}}
{{- $out = append $out (printf "%s:%s" (include "specserve.redisSentinelHost" (dict "ctx" $ "i" $i)) (include "specserve.redisSentinelPort" $)) -}}
{{- end -}}
{{- join " " $out -}}
{{- end -}}

{{/* host:port of every Cluster node (bundled), space-separated */}}
{{- define "specserve.redisClusterAddrs" -}}
{{- $out := list -}}
{{- range $i := until (int .Values.redis.bundled.cluster.nodes) -}}
{{- $out = append $out (printf "%s:%d" (include "specserve.redisNodeHost" (dict "ctx" $ "i" $i)) (int $.Values.redis.bundled.port)) -}}
{{- end -}}
{{- join " " $out -}}
{{- end -}}

{{/* What values.schema.json cannot say. Fails the render; returns nothing. */}}
{{- define "specserve.redisCheck" -}}
{{- $v := .Values.redis -}}
{{- $b := $v.bundled -}}
{{- $e := $v.external -}}
{{- $where := printf "redis.source=%s and redis.mode=%s" $v.source $v.mode -}}
{{- if and (eq $v.mode "cluster") (ne (int $v.db) 0) -}}
{{- fail (printf "redis.db is %d but a Redis Cluster has only db 0: set redis.db to 0 with redis.mode=cluster" (int $v.db)) -}}
{{- end -}}
{{- if eq $v.source "external" -}}
{{- if and (eq $v.mode "standalone") (not $e.url) -}}
{{- fail (printf "redis.external.url is required with %s (redis:// or rediss://)" $where) -}}
{{- end -}}
{{- if and (eq $v.mode "sentinel") (not $e.sentinels) -}}
{{- fail (printf "redis.external.sentinels is required with %s: the sentinels as [host:port, ...]" $where) -}}
{{- end -}}
{{- if and (eq $v.mode "sentinel") (not $e.masterName) -}}
{{- fail (printf "redis.external.masterName is required with %s: the master name the sentinels monitor" $where) -}}
{{- end -}}
{{- if and (eq $v.mode "cluster") (not $e.nodes) -}}
{{- fail (printf "redis.external.nodes is required with %s: some or all Cluster nodes as [host:port, ...]" $where) -}}
{{- end -}}
{{- if and (ne $v.mode "standalone") $e.caSecret -}}
{{- fail (printf "redis.external.caSecret: TLS to Redis is supported with redis.mode=standalone (rediss://) only, not with redis.mode=%s" $v.mode) -}}
{{- end -}}
{{- else -}}
{{- if and (eq $v.mode "sentinel") (lt (int $b.replicas) 2) -}}
{{- fail (printf "redis.bundled.replicas is %d: redis.mode=sentinel needs at least 2 data nodes (a primary and a replica)" (int $b.replicas)) -}}
{{- end -}}
{{- if and (eq $v.mode "sentinel") (gt (int $b.sentinel.quorum) (int $b.sentinel.replicas)) -}}
{{- fail (printf "redis.bundled.sentinel.quorum (%d) cannot exceed redis.bundled.sentinel.replicas (%d)" (int $b.sentinel.quorum) (int $b.sentinel.replicas)) -}}
{{- end -}}
{{- $least := mul 3 (add 1 (int $b.cluster.replicasPerMaster)) -}}
{{- if and (eq $v.mode "cluster") (lt (int $b.cluster.nodes) (int $least)) -}}
{{- fail (printf "redis.bundled.cluster.nodes is %d: a Cluster of 3 primaries with %d replica(s) each needs at least %d (3 x (1 + redis.bundled.cluster.replicasPerMaster))" (int $b.cluster.nodes) (int $b.cluster.replicasPerMaster) (int $least)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The services' Redis URL; "$(REDIS_PASSWORD)" where a password is set (the container
     defines REDIS_PASSWORD first, from the Secret). */}}
{{- define "specserve.redisUrl" -}}
{{- $v := .Values.redis -}}
{{- $auth := "" -}}
{{- if or (eq $v.source "bundled") $v.external.existingSecret -}}
{{- $auth = ":$(REDIS_PASSWORD)@" -}}
{{- end -}}
{{- if eq $v.source "bundled" -}}
{{- if eq $v.mode "standalone" -}}
{{- printf "redis://%s%s:%d/%d" $auth (include "specserve.svcHost" (dict "ctx" . "name" (include "specserve.redisName" .))) (int $v.bundled.port) (int $v.db) -}}
{{- else if eq $v.mode "sentinel" -}}
{{- printf "redis+sentinel://%s%s/%s/%d" $auth (include "specserve.redisSentinelAddrs" . | replace " " ",") $v.bundled.sentinel.masterName (int $v.db) -}}
{{- else -}}
{{- $nodes := splitList " " (include "specserve.redisClusterAddrs" .) -}}
{{- printf "redis+cluster://%s%s" $auth (slice $nodes 0 3 | join ",") -}}
{{- end -}}
{{- else -}}
{{- if eq $v.mode "standalone" -}}
{{- $parts := splitn "://" 2 $v.external.url -}}
{{- printf "%s://%s%s" $parts._0 $auth $parts._1 -}}
{{- else if eq $v.mode "sentinel" -}}
{{- printf "redis+sentinel://%s%s/%s/%d" $auth (join "," $v.external.sentinels) $v.external.masterName (int $v.db) -}}
{{- else -}}
{{- printf "redis+cluster://%s%s" $auth (join "," $v.external.nodes) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Redis connection: REDIS_PASSWORD (when there is one) and the URL under `name`, the same
     variable in every mode. (dict "ctx" $ "name" "SPECSERVE_ROUTER_REDIS_URL") */}}
{{- define "specserve.redisEnv" -}}
{{- $v := .ctx.Values.redis -}}
{{- include "specserve.redisCheck" .ctx -}}
{{- if eq $v.source "bundled" }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specserve.redisSecretName" .ctx }}
      key: password
{{- else if $v.external.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $v.external.existingSecret }}
      key: {{ $v.external.passwordKey }}
{{- end }}
- name: {{ .name }}
  value: {{ include "specserve.redisUrl" .ctx | quote }}
{{- include "specserve.redisCaEnv" .ctx }}
{{- end -}}

{{/* rediss:// with a private CA (external standalone only): OpenSSL's default bundle becomes
     the mounted one. */}}
{{- define "specserve.redisCaEnabled" -}}
{{- if and (eq .Values.redis.source "external") (eq .Values.redis.mode "standalone") .Values.redis.external.caSecret -}}
true
{{- end -}}
{{- end -}}

{{- define "specserve.redisCaEnv" -}}
{{- if include "specserve.redisCaEnabled" . }}
- name: SSL_CERT_FILE
  value: /etc/specserve/redis-ca/ca.crt
{{- end }}
{{- end -}}

{{- define "specserve.redisCaVolume" -}}
{{- if include "specserve.redisCaEnabled" . }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.external.caSecret }}
{{- end }}
{{- end -}}

{{- define "specserve.redisCaMount" -}}
{{- if include "specserve.redisCaEnabled" . }}
- name: redis-ca
  mountPath: /etc/specserve/redis-ca
  readOnly: true
{{- end }}
{{- end -}}

{{/* The official image's redis user. */}}
{{- define "specserve.redisPodSecurityContext" -}}
runAsNonRoot: true
runAsUser: 999
runAsGroup: 999
fsGroup: 999
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Placement of the bundled Redis pods of the sentinel and cluster modes:
     (dict "ctx" $ "component" "redis") */}}
{{- define "specserve.redisPlacement" -}}
{{- $b := .ctx.Values.redis.bundled -}}
{{- with $b.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $b.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "specserve.affinity" (dict "ctx" .ctx "affinity" $b.affinity "labels" (include "specserve.selectorLabels" (dict "ctx" .ctx "component" .component))) }}
{{- end -}}

{{/* PING with the password (REDISCLI_AUTH) on `port`: readiness and liveness. */}}
{{- define "specserve.redisProbes" -}}
readinessProbe:
  exec:
    command: ["sh", "-c", {{ printf "test \"$(redis-cli -p %d ping)\" = PONG" (int .port) | quote }}]
  periodSeconds: 5
  timeoutSeconds: 3
livenessProbe:
  exec:
    command: ["sh", "-c", {{ printf "test \"$(redis-cli -p %d ping)\" = PONG" (int .port) | quote }}]
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* Egress of a Redis client (router, target workers) to the bundled Redis: the data nodes on
     the client port (every mode), and the sentinels (mode sentinel). Nothing for an external
     Redis (networkPolicy.egress.extra). (dict "ctx" $ "redis" <labels> "sentinel" <labels>) */}}
{{- define "specserve.redisClientEgress" -}}
{{- $v := .ctx.Values.redis -}}
{{- if eq $v.source "bundled" }}
- to:
    - podSelector:
        matchLabels:
          {{- .redis | nindent 10 }}
  ports:
    - port: {{ $v.bundled.port }}
      protocol: TCP
{{- if eq $v.mode "sentinel" }}
- to:
    - podSelector:
        matchLabels:
          {{- .sentinel | nindent 10 }}
  ports:
    - port: {{ include "specserve.redisSentinelPort" .ctx }}
      protocol: TCP
{{- end }}
{{- end }}
{{- end -}}
