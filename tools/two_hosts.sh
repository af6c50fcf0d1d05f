#!/usr/bin/env bash
# Two "hosts" on one machine, for trying a run across hosts (torchrun --nnodes 2) without a second machine.
#
# Each host is a process holding its own network namespace (joined to the other's by a veth pair), UTS namespace
# (its own hostname) and mount namespace (its own fresh tmpfs on /dev/shm); traffic between them never leaves
# the machine. Needs root (or whatever lets `unshare --net --uts --mount` and `ip link` work).
#
#   tools/two_hosts.sh up            # host a (10.77.0.1) and host b (10.77.0.2)
#   tools/two_hosts.sh run a CMD...  # CMD on host a, in this directory
#   tools/two_hosts.sh kill b        # host b goes away: every process on it is killed (SIGKILL), its network stays
#   tools/two_hosts.sh unplug b      # host b's network goes away: its end of the veth is taken down, its processes stay
#   tools/two_hosts.sh plug b        # and comes back
#   tools/two_hosts.sh shape 100mbit # both ends of the veth send at most 100 Mbit/s (tc tbf); `shape none` undoes it
#   tools/two_hosts.sh down          # stop both; the veth pair goes with them
#
# MOIRAI_TWO_HOSTS_DIR holds the hosts' state (default /tmp/moirai-two-hosts); give each concurrent pair its own.
# MOIRAI_TWO_HOSTS_NET is the /24 the two addresses come from (default 10.77.0).
set -euo pipefail

STATE_DIR="${MOIRAI_TWO_HOSTS_DIR:-/tmp/moirai-two-hosts}"
NET="${MOIRAI_TWO_HOSTS_NET:-10.77.0}"
HOSTS=(a b)
IP="${IP:-$(command -v ip || echo /usr/sbin/ip)}"

address_of() { [[ "$1" == a ]] && echo "$NET.1" || echo "$NET.2"; }

holder_of() {
    local pid_file="$STATE_DIR/$1.pid"
    [[ -s "$pid_file" ]] || { echo "two_hosts: host $1 is not up (no $pid_file): run '$0 up'" >&2; exit 2; }
    cat "$pid_file"
}

# The process that holds a host's namespaces: sets its hostname, mounts its /dev/shm, then waits.
start_holder() {
    local host="$1"
    unshare --net --uts --mount --propagation private --fork \
        sh -c "hostname moirai-host-$host && mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm \
               && touch '$STATE_DIR/$host.ready' && exec sleep infinity" \
        </dev/null >/dev/null 2>"$STATE_DIR/$host.log" &
    echo $! >"$STATE_DIR/$host.unshare.pid"
}

# The pid inside the namespaces: unshare --fork's child (the sleep).
wait_for_holder() {
    local host="$1" unshare_pid
    unshare_pid="$(cat "$STATE_DIR/$host.unshare.pid")"
    for _ in $(seq 100); do
        if [[ -e "$STATE_DIR/$host.ready" ]]; then
            pgrep -P "$unshare_pid" >"$STATE_DIR/$host.pid" && return 0
        fi
        kill -0 "$unshare_pid" 2>/dev/null || break
        sleep 0.05
    done
    echo "two_hosts: host $host did not start: $(cat "$STATE_DIR/$host.log")" >&2
    return 1
}

up() {
    mkdir -p "$STATE_DIR"
    [[ ! -e "$STATE_DIR/a.pid" ]] || { echo "two_hosts: already up ($STATE_DIR); run '$0 down' first" >&2; exit 2; }
    trap 'down' ERR
    for host in "${HOSTS[@]}"; do start_holder "$host"; done
    for host in "${HOSTS[@]}"; do wait_for_holder "$host"; done
    # Interface names are global until moved into the namespaces: make them unique to this pair.
    local suffix end_a end_b
    suffix="$(printf '%s' "$STATE_DIR" | cksum | cut -d' ' -f1 | cut -c1-8)"
    end_a="mha$suffix" end_b="mhb$suffix"
    "$IP" link add "$end_a" type veth peer name "$end_b"
    "$IP" link set "$end_a" netns "$(holder_of a)"
    "$IP" link set "$end_b" netns "$(holder_of b)"
    for host in "${HOSTS[@]}"; do
        local end="mh$host$suffix"
        in_host "$host" "$IP" link set lo up
        in_host "$host" "$IP" addr add "$(address_of "$host")/24" dev "$end"
        in_host "$host" "$IP" link set "$end" up
        echo "host $host: $(in_host "$host" hostname), $(address_of "$host") on $end"
    done
    trap - ERR
}

# Every process in a host's network namespace but the holder: SIGKILL, as a machine that loses power.
kill_processes_of() {
    local host="$1" holder namespace
    [[ -s "$STATE_DIR/$host.pid" ]] || return 0
    holder="$(cat "$STATE_DIR/$host.pid")"
    namespace="$(readlink "/proc/$holder/ns/net" 2>/dev/null || true)"
    [[ -n "$namespace" ]] || return 0
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        if [[ "$pid" != "$holder" && "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" == "$namespace" ]]; then
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
}

down() {
    for host in "${HOSTS[@]}"; do
        # The host's processes first, the holder last.
        kill_processes_of "$host"
        if [[ -s "$STATE_DIR/$host.pid" ]]; then
            kill -9 "$(cat "$STATE_DIR/$host.pid")" 2>/dev/null || true
        fi
        if [[ -s "$STATE_DIR/$host.unshare.pid" ]]; then
            kill "$(cat "$STATE_DIR/$host.unshare.pid")" 2>/dev/null || true
        fi
        rm -f "$STATE_DIR/$host".{pid,unshare.pid,ready,log}
    done
    rmdir "$STATE_DIR" 2>/dev/null || true
}

# A host's end of the veth pair.
veth_end() {
    in_host "$1" "$IP" -o link show type veth | awk -F': ' '{print $2}' | cut -d@ -f1
}

# Take a host's end of the veth down (or up): packets to and from it are dropped, as when a cable is pulled; no
# connection is reset, so its peers learn of it only from their timeouts.
set_link() {
    local host="$1" state="$2" end
    end="$(veth_end "$host")"
    in_host "$host" "$IP" link set "$end" "$state"
    echo "host $host: $end $state"
}

# The token bucket's size for a rate (e.g. 100mbit): 0.5 ms of it, at least 4 KiB (two full frames and headroom). A
# message leaves at the veth's own speed until the bucket is empty, which a real link of that rate never does (64 KiB
# let a lone 256 KiB message cross 100 Mbit/s in 16 ms instead of 21), so the bucket stays small; smaller still
# (0.125 ms, GSO packets to fit) made each message cost its hosts' cores more in a stream: the even split across
# 1 Gbit/s served 0.82-0.83x its predicted requests/s, against 0.96-0.97x.
burst_bytes() {
    local rate="${1,,}" number unit
    [[ "$rate" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || { echo "two_hosts: a rate like 100mbit or 1gbit, not '$1'" >&2; exit 2; }
    number="${BASH_REMATCH[1]}" unit="${BASH_REMATCH[2]}"
    local bits_per_s=$((number * $([[ $unit == kbit ]] && echo 1000 || ([[ $unit == mbit ]] && echo 1000000 || echo 1000000000))))
    local bytes=$((bits_per_s / 8 / 2000))
    echo $((bytes > 4096 ? bytes : 4096))
}

# The largest GSO packet the veth end makes under a bucket of BYTES: a frame's worth less than the bucket (at most
# 64 KiB, the default). tbf splits a GSO packet larger than its bucket into frames in software, on the sending host's
# core, which a network card with segmentation offload does not do: over 1 Gbit/s with a 62 KB bucket a 256 KiB
# message took 1.5 ms of its sender's core, with GSO packets that fit 0.1 ms, as unshaped (bench/RESULTS.md
# section 15).
gso_bytes() {
    local bytes=$(($1 - 1514))
    echo $((bytes < 65536 ? bytes : 65536))
}

# A token bucket on each end of the veth (netem is missing on many kernels; tbf and htb are not), and GSO packets
# that fit it.
shape() {
    local rate="$1" host end burst
    for host in "${HOSTS[@]}"; do
        end="$(veth_end "$host")"
        in_host "$host" tc qdisc del dev "$end" root 2>/dev/null || true
        if [[ "$rate" != none ]]; then
            burst="$(burst_bytes "$rate")"
            in_host "$host" tc qdisc add dev "$end" root tbf rate "$rate" burst "$burst" latency 200ms
            in_host "$host" "$IP" link set dev "$end" gso_max_size "$(gso_bytes "$burst")"
        else
            in_host "$host" "$IP" link set dev "$end" gso_max_size 65536
        fi
        echo "host $host: $end $(in_host "$host" tc qdisc show dev "$end" root), $(in_host "$host" "$IP" -d link show dev "$end" | grep -o 'gso_max_size [0-9]*')"
    done
}

in_host() {
    local host="$1"
    shift
    nsenter --target "$(holder_of "$host")" --net --uts --mount --wd="$PWD" "$@"
}

case "${1:-}" in
up) up ;;
down) down ;;
shape)
    [[ $# -eq 2 ]] || { echo "usage: $0 shape RATE|none (a tc rate: 1gbit, 100mbit)" >&2; exit 2; }
    shape "$2"
    ;;
kill)
    [[ $# -eq 2 && " ${HOSTS[*]} " == *" $2 "* ]] || { echo "usage: $0 kill a|b" >&2; exit 2; }
    holder_of "$2" >/dev/null
    kill_processes_of "$2"
    ;;
unplug | plug)
    [[ $# -eq 2 && " ${HOSTS[*]} " == *" $2 "* ]] || { echo "usage: $0 $1 a|b" >&2; exit 2; }
    if [[ "$1" == unplug ]]; then set_link "$2" down; else set_link "$2" up; fi
    ;;
run)
    [[ $# -ge 3 && " ${HOSTS[*]} " == *" $2 "* ]] || { echo "usage: $0 run a|b CMD..." >&2; exit 2; }
    host="$2"
    shift 2
    in_host "$host" "$@"
    ;;
*)
    echo "usage: $0 up | run a|b CMD... | kill a|b | unplug a|b | plug a|b | shape RATE|none | down" >&2
    exit 2
    ;;
esac
