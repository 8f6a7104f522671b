{{/* The start scripts of the bundled Redis pods in the sentinel and cluster modes: the data of
     the ConfigMap <fullname>-redis-scripts (redis-nodes.yaml), mounted at /scripts. POSIX sh
     with the redis image's own tools (redis-cli, getent, awk, timeout). */}}
{{- define "specserve.redisScripts" -}}
{{- $v := .Values.redis -}}
{{- $b := $v.bundled -}}
lib.sh: |
  # What the scripts share; the addresses are rendered by the chart.
  PORT={{ int $b.port }}
  NODE_SUFFIX={{ include "specserve.redisNodeSuffix" . }}
  {{- if eq $v.mode "sentinel" }}
  SENTINEL_PORT={{ include "specserve.redisSentinelPort" . }}
  SENTINEL_SUFFIX={{ include "specserve.redisSentinelSuffix" . }}
  SENTINELS="{{ range $i := until (int $b.sentinel.replicas) }}{{ if $i }} {{ end }}{{ include "specserve.redisSentinelHost" (dict "ctx" $ "i" $i) }}{{ end }}"
  MASTER_NAME={{ $b.sentinel.masterName }}
  FIRST_PRIMARY={{ include "specserve.redisNodeHost" (dict "ctx" . "i" 0) }}
  {{- else }}
  NODES="{{ include "specserve.redisClusterAddrs" . }}"
  {{- end }}

  log() { echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $*"; }

  # Wait (up to 2 min) until a pod's DNS name resolves: it appears once the pod has an IP.
  wait_resolvable() {
    i=0
    until getent hosts "$1" >/dev/null 2>&1; do
      i=$((i + 1))
      if [ "$i" -gt 120 ]; then log "$1 does not resolve yet"; return 0; fi
      sleep 1
    done
  }
  {{- if eq $v.mode "sentinel" }}

  # A sentinel takes no password: the data nodes' REDISCLI_AUTH is left out.
  sentinel_cli() {
    host=$1
    shift
    env -u REDISCLI_AUTH timeout 3 redis-cli -h "$host" -p "$SENTINEL_PORT" --raw "$@"
  }

  # The primary the sentinels name now: the answer with the highest config epoch (a sentinel
  # that has just started may still name the first one); nothing when no sentinel answers.
  current_primary() {
    best=""
    best_epoch=-1
    for s in $SENTINELS; do
      host=$(sentinel_cli "$s" sentinel get-master-addr-by-name "$MASTER_NAME" 2>/dev/null | head -n 1)
      [ -n "$host" ] || continue
      epoch=$(sentinel_cli "$s" sentinel master "$MASTER_NAME" 2>/dev/null |
        awk 'prev == "config-epoch" { print; exit } { prev = $0 }')
      case $epoch in '' | *[!0-9]*) epoch=0 ;; esac
      if [ "$epoch" -gt "$best_epoch" ]; then
        best=$host
        best_epoch=$epoch
      fi
    done
    echo "$best"
  }
  {{- else }}

  # Pod IPs change and Cluster nodes gossip by IP: before a restarted node starts, point every
  # node of its nodes.conf at the address its DNS name has now (Redis 7 keeps the name there,
  # after the comma of the address field), and itself at its own new IP.
  refresh_addresses() {
    awk -v self_ip="$POD_IP" '
      $1 != "vars" && NF >= 8 && index($2, ",") > 0 {
        comma = index($2, ",")
        head = substr($2, 1, comma - 1)
        tail = substr($2, comma)
        split(substr(tail, 2), aux, ",")
        host = aux[1]
        if (match(head, /:[0-9]+@[0-9]+$/)) {
          ip = ""
          if ($3 ~ /myself/) {
            ip = self_ip
          } else if (host ~ /^[A-Za-z0-9.-]+$/) {
            cmd = "getent hosts " host
            if ((cmd | getline line) > 0) { split(line, f, " "); ip = f[1] }
            close(cmd)
          }
          if (ip != "") $2 = ip substr(head, RSTART) tail
        }
      }
      { print }' "$1" > "$1.new"
    mv "$1.new" "$1"
  }

  # The entries the formed Cluster holds for this pod's DNS name, as one peer sees them:
  # "<id> <flags> <number of slot ranges>" each; nothing when no peer answers.
  old_entries() {
    for node in $NODES; do
      host=${node%:*}
      [ "$host" != "$1" ] || continue
      out=$(redis-cli -h "$host" -p "$PORT" cluster nodes 2>/dev/null) || continue
      [ -n "$out" ] || continue
      echo "$out" | awk -v me="$1" -v myid="${2:-}" '
        $1 != myid && index($2 ",", "," me ",") > 0 { print $1, $3, NF - 8 }'
      return 0
    done
  }

  # A node that starts empty (its volume was lost) while the Cluster holds an entry for it
  # must not answer at that entry's address before the Cluster has failed it (and promoted
  # its replica, if it was a primary): replicas would sync from the empty node, and an entry
  # whose address answers with another ID is never failed. Waits up to 3 min.
  wait_until_failed() {
    i=0
    while old_entries "$1" | awk '$2 !~ /(^|,)fail(,|$)/ { found = 1 } END { exit !found }'; do
      if [ "$i" -ge 90 ]; then log "the Cluster has not failed this pod's old entry: starting anyway"; return 0; fi
      [ "$i" -gt 0 ] || log "the Cluster still counts on this pod's old entry: waiting until it fails it over"
      i=$((i + 1))
      sleep 2
    done
  }

  # Then, once redis-server answers, the node joins the formed Cluster again as a replica (of
  # the primary with the fewest), after its old entry (failed, no slots) is forgotten
  # everywhere. On a first install nothing is formed yet: the create Job joins every node, and
  # this stops once it has.
  join_when_up() {
    self=$1
    until [ "$(redis-cli -p "$PORT" ping 2>/dev/null)" = PONG ]; do sleep 1; done
    myid=$(redis-cli -p "$PORT" cluster myid)
    i=0
    while [ "$i" -lt 150 ]; do
      if ! redis-cli -p "$PORT" cluster info | grep -q '^cluster_known_nodes:1'; then
        log "this node is part of the Cluster"
        return 0
      fi
      for node in $NODES; do
        host=${node%:*}
        [ "$host" != "$self" ] || continue
        redis-cli -h "$host" -p "$PORT" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || continue
        old=$(old_entries "$self" "$myid")
        if echo "$old" | awk '$2 !~ /(^|,)fail(,|$)/ || $3 > 0 { found = 1 } END { exit !found }'; then
          log "the Cluster has not failed over this pod's old entry yet: waiting"
          break
        fi
        for id in $(echo "$old" | awk '{ print $1 }'); do
          for peer in $NODES; do
            [ "${peer%:*}" = "$self" ] || redis-cli -h "${peer%:*}" -p "$PORT" cluster forget "$id" >/dev/null 2>&1 || true
          done
        done
        log "the Cluster is formed (seen from $host): joining it as a replica"
        redis-cli --cluster add-node "$self:$PORT" "$node" --cluster-slave || log "joining the Cluster failed"
        return 0
      done
      i=$((i + 1))
      sleep 2
    done
    log "no formed Cluster took this node in: the create Job (helm upgrade) or an operator must"
  }
  {{- end }}
{{- if eq $v.mode "sentinel" }}
redis.sh: |
  # A data node of mode sentinel. The sentinels decide who the primary is; this picks the role
  # the node starts in:
  # - a sentinel answers: a replica of the primary it names, or the primary if that is this pod;
  # - none answers (a first install, every sentinel down): pod 0 is the primary, the others
  #   its replicas.
  # A node the sentinels still name as the primary whose data is gone (persistence off and the
  # pod moved) asks them for a failover first: an empty primary would empty its replicas too.
  set -eu
  . /scripts/lib.sh
  self="$POD_NAME$NODE_SUFFIX"
  primary=$(current_primary)
  if [ "$primary" = "$self" ] && [ ! -d /data/appendonlydir ]; then
    log "the sentinels name this pod the primary, but its data is gone: asking for a failover"
    asked=""
    for s in $SENTINELS; do
      reply=$(sentinel_cli "$s" sentinel failover "$MASTER_NAME" 2>/dev/null | head -n 1)
      case $reply in OK | INPROG*) asked=$s; break ;; esac
    done
    i=0
    while [ -n "$asked" ] && [ "$i" -lt 60 ] && [ "$primary" = "$self" ]; do
      sleep 2
      i=$((i + 1))
      primary=$(current_primary)
    done
  fi
  [ -n "$primary" ] || primary=$FIRST_PRIMARY
  if [ "$primary" = "$self" ]; then
    log "starting as the primary"
    exec redis-server "$@"
  fi
  log "starting as a replica of $primary"
  exec redis-server "$@" --replicaof "$primary" "$PORT"
sentinel.sh: |
  # A sentinel. Sentinels rewrite their config with what they learn, so it lives in the
  # emptyDir /data: kept across container restarts, written afresh in a new pod from
  # /scripts/sentinel.conf, monitoring the primary the other sentinels name now (pod 0 when none
  # answers: a first install), with the data nodes' password and this pod's DNS name.
  set -eu
  . /scripts/lib.sh
  conf=/data/sentinel.conf
  if [ ! -s "$conf" ]; then
    primary=$(current_primary)
    [ -n "$primary" ] || primary=$FIRST_PRIMARY
    log "monitoring $MASTER_NAME at $primary"
    wait_resolvable "$primary"
    {
      awk -v primary="$primary" '$1 == "sentinel" && $2 == "monitor" { $4 = primary } { print }' /scripts/sentinel.conf
      echo "sentinel auth-pass $MASTER_NAME $REDIS_PASSWORD"
      echo "sentinel announce-ip $POD_NAME$SENTINEL_SUFFIX"
      echo "sentinel announce-port $SENTINEL_PORT"
    } > "$conf.new"
    mv "$conf.new" "$conf"
  fi
  exec redis-server "$conf" --sentinel
sentinel.conf: |
  port {{ include "specserve.redisSentinelPort" . }}
  # no password on the sentinels (the data nodes have one): the NetworkPolicies guard them
  protected-mode no
  dir /tmp
  # data nodes and sentinels are known by their DNS names, which survive a pod's new IP
  sentinel resolve-hostnames yes
  sentinel announce-hostnames yes
  sentinel monitor {{ $b.sentinel.masterName }} {{ include "specserve.redisNodeHost" (dict "ctx" . "i" 0) }} {{ int $b.port }} {{ int $b.sentinel.quorum }}
  sentinel down-after-milliseconds {{ $b.sentinel.masterName }} {{ int $b.sentinel.downAfterMilliseconds }}
  sentinel failover-timeout {{ $b.sentinel.masterName }} {{ int $b.sentinel.failoverTimeout }}
  sentinel parallel-syncs {{ $b.sentinel.masterName }} 1
{{- else }}
redis.sh: |
  # A node of mode cluster. Its identity and its view of the Cluster are /data/nodes.conf:
  # - there (a container restart, or persistence on): the addresses in it are refreshed first;
  # - absent (a first install, or persistence off and the pod moved): the node starts empty
  #   and, if the Cluster is formed already, joins it as a replica once its old entry is
  #   failed over (wait_until_failed, join_when_up).
  set -eu
  . /scripts/lib.sh
  if [ -s /data/nodes.conf ]; then
    refresh_addresses /data/nodes.conf
  else
    wait_until_failed "$POD_NAME$NODE_SUFFIX"
    join_when_up "$POD_NAME$NODE_SUFFIX" &
  fi
  exec redis-server "$@"
{{- end }}
{{- end -}}
