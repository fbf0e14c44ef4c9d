#!/usr/bin/env bash
# Start or join a Ray cluster by hand, then point `pp-runtime run` at it.
#
#   launch/ray_cluster.sh head [--port 6379] [--ip 127.0.0.1] [ray start args...]
#   launch/ray_cluster.sh worker HEAD_IP:PORT [--ip THIS_NODE_IP] [ray start args...]
#   launch/ray_cluster.sh stop
#
# head binds Ray to --ip (default 127.0.0.1: this machine only; give the node's cluster
# address to take workers), starts the dashboard on DASHBOARD_HOST:DASHBOARD_PORT (default
# 127.0.0.1:8265; RAY_DASHBOARD=false: none) and prints its URL, how to get the token it
# asks for, and the `pp-runtime run` line to use. Every Ray process here, and the printed
# driver line, push metrics every RAY_metrics_report_interval_ms (default 2000 here; Ray's
# own is 10000: docs/monitoring.md). Each node runs one
# `ray start --block` in the background; its pid and log are kept in $RAY_CLUSTER_DIR
# (default /tmp/pp-runtime-ray-$UID), and `stop` SIGTERMs that process only, which stops
# this node's Ray (not other Ray instances on the machine, as `ray stop` would).
# Extra arguments go to `ray start` (--num-cpus 8, --num-gpus 8, --temp-dir DIR, ports...).
# Token auth is on (RAY_AUTH_MODE=token): every node and the driver need the same token
# (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; docs/slurm.md).
set -euo pipefail

STATE=${RAY_CLUSTER_DIR:-/tmp/pp-runtime-ray-$(id -u)}
PID_FILE=$STATE/ray.pid LOG=$STATE/ray.log
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
export RAY_metrics_report_interval_ms=${RAY_metrics_report_interval_ms:-2000}

usage() { sed -n '4,6p' "$0" | sed 's/^# */usage: /' >&2; exit 2; }

running() { [[ -f $PID_FILE ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; }

start() {  # start ARGS...: `ray start --block ARGS` in the background, wait until it is up
    if running; then
        echo "Ray already runs here (pid $(cat "$PID_FILE")); launch/ray_cluster.sh stop first" >&2
        exit 1
    fi
    mkdir -p "$STATE"
    if [[ $RAY_AUTH_MODE == token ]]; then (umask 077; ray get-auth-token --generate >/dev/null 2>&1); fi  # the token file 0600
    nohup ray start --block --disable-usage-stats --log-color=false "$@" >"$LOG" 2>&1 </dev/null &
    echo $! >"$PID_FILE"
    for _ in $(seq 120); do
        grep -q "Ray runtime started" "$LOG" && return 0
        running || { cat "$LOG" >&2; echo "ray start failed (log above, $LOG)" >&2; exit 1; }
        sleep 0.5
    done
    echo "Ray did not start within 60 s; see $LOG" >&2
    exit 1
}

cmd_head() {
    local port=6379 ip=127.0.0.1 extra=()
    while (($#)); do
        case $1 in
            --port) port=$2; shift 2 ;;
            --ip) ip=$2; shift 2 ;;
            *) extra+=("$1"); shift ;;
        esac
    done
    local env_prefix="RAY_AUTH_MODE=$RAY_AUTH_MODE RAY_metrics_report_interval_ms=$RAY_metrics_report_interval_ms"
    if [[ $ip == 127.* ]]; then  # Ray's switch that keeps every port on 127.0.0.1
        export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
        env_prefix+=" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
    fi
    local dash=${RAY_DASHBOARD:-true} dash_host=${DASHBOARD_HOST:-127.0.0.1} dash_port=${DASHBOARD_PORT:-8265}
    local dash_args=(--include-dashboard=false)
    if [[ $dash == true ]]; then
        dash_args=(--include-dashboard=true --dashboard-host="$dash_host" --dashboard-port="$dash_port")
    fi
    start --head --node-ip-address="$ip" --port="$port" "${dash_args[@]}" "${extra[@]}"
    echo "$ip:$port" >"$STATE/head"
    echo "Ray head up at $ip:$port (pid $(cat "$PID_FILE"), log $LOG)."
    if [[ $dash == true ]]; then
        local ask=""
        if [[ $RAY_AUTH_MODE == token ]]; then ask="  (it asks for the token: paste what \`ray get-auth-token\` prints)"; fi
        echo "Dashboard:  http://$dash_host:$dash_port$ask"
        if [[ $dash_host == 127.* ]]; then
            echo "  from another machine:  ssh -L $dash_port:127.0.0.1:$dash_port $(hostname), then the URL above"
        fi
    fi
    if [[ $ip != 127.* ]]; then
        echo "On every other node:  launch/ray_cluster.sh worker $ip:$port"
    fi
    echo "Then run:  $env_prefix pp-runtime run --config CONFIG --workload --set ray_address=$ip:$port"
    echo "Or serve:  $env_prefix pp-runtime serve --config CONFIG --set ray_address=$ip:$port  (ready when: curl -sf http://127.0.0.1:8000/health)"
}

cmd_worker() {
    (($#)) || usage
    local head=$1 ip="" extra=()
    shift
    while (($#)); do
        case $1 in
            --ip) ip=$2; shift 2 ;;
            *) extra+=("$1"); shift ;;
        esac
    done
    if [[ -z $ip && $head == 127.* ]]; then ip=127.0.0.1; fi
    unset RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER  # =0 makes `ray start --address` refuse to join
    # no --ip: Ray takes the address this node reaches the head from
    start --address="$head" ${ip:+--node-ip-address="$ip"} "${extra[@]}"
    echo "Ray worker joined $head (pid $(cat "$PID_FILE"), log $LOG)."
}

cmd_stop() {
    if ! running; then
        echo "no Ray started by launch/ray_cluster.sh here"
        rm -f "$PID_FILE"
        return 0
    fi
    local pid
    pid=$(cat "$PID_FILE")
    kill -TERM "$pid"  # ray start --block stops its raylet (and the GCS on the head)
    for _ in $(seq 90); do
        if ! kill -0 "$pid" 2>/dev/null; then
            # `ray start` leaves /tmp/ray/ray_current_cluster naming our head; a later
            # address-less ray.init or state API call would try to join it
            local current=/tmp/ray/ray_current_cluster
            if [[ -f $STATE/head && -f $current && $(cat "$current") == "$(cat "$STATE/head")" ]]; then
                rm -f "$current"
            fi
            rm -f "$PID_FILE" "$STATE/head"
            echo "Ray stopped (pid $pid)"
            return 0
        fi
        sleep 0.5
    done
    echo "Ray (pid $pid) still running after 45 s; kill -KILL $pid" >&2
    exit 1
}

case ${1:-} in
    head) shift; cmd_head "$@" ;;
    worker) shift; cmd_worker "$@" ;;
    stop) cmd_stop ;;
    *) usage ;;
esac
