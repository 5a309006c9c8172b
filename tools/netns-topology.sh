#!/usr/bin/env bash
# A slow inter-node link on one machine: two "nodes", each a network namespace with its own
# loopback, joined by a veth pair whose two ends are shaped with tc (netem delay + rate where the
# kernel has sch_netem, else tbf rate only; the script says which). Ranks of one node talk over the
# namespace's loopback; every byte between nodes crosses the veth pair, whose counters
# (/sys/class/net/<veth>/statistics/{tx,rx}_bytes, read inside node 0) are the inter-node bytes.
#
#   netns-topology.sh check                      exit 0 when namespaces can be made here, else
#                                                exit 77 with the reason (not root, no ip, ...)
#   netns-topology.sh up   [--name N] [--rate R] [--delay D]
#   netns-topology.sh down [--name N]
#   netns-topology.sh counters [--name N]        "<tx_bytes> <rx_bytes>" of node 0's veth end
#   netns-topology.sh run  [--name N] [--rate R] [--delay D] [--ranks-per-node L]
#                          [--offloadctl PATH] [--json FILE] [--timeout-s S] [--mark REGEX]
#                          -- CMD ARGS...
#       up, then `offloadctl launch -n 2L --ranks-per-node L --rdzv-dir <tmp>` of CMD with each rank
#       in its node's namespace (rank r on node r / L, Gloo bound to that node's address through
#       STRATA_GLOO_HOSTNAME, rendezvous through a file store on the shared filesystem), then
#       prints the inter-node bytes (veth counters during the run) and the elapsed time, and
#       always tears the topology down (also on failure or Ctrl-C). --mark REGEX: every line the
#       ranks write to stderr that matches REGEX (bash =~) samples the counters and prints the
#       bytes since the previous mark (or the start), e.g. --mark 'step [0-9]+/' with
#       `offloadctl bench engine`, whose rank 0 prints a line as each step ends: the inter-node
#       bytes of each step. The JSON file lists them under "marks".
#   netns-topology.sh exec-rank -- CMD ARGS...   (what `run` launches per rank) enters the
#                                                namespace of node RANK / LOCAL_WORLD_SIZE
#
# Defaults: --name stn<pid> (at most 12 characters: interface names are <= 15), --rate 1gbit,
# --delay 1ms, --ranks-per-node 2; --rate none: no shaping (the same topology at veth speed, the
# reference for a slow-link figure). Node k is namespace <name>-n<k> with address 10.213.0.<k+1>/24
# on veth <name>-v<k>; the subnet is private to the pair, so topologies never collide.
# Requires root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ip and tc. The script's own
# messages go to stderr, so the command's stdout (e.g. --json) stays clean.
set -euo pipefail

name="stn$$"
rate="1gbit"
delay="1ms"
per_node=2
offloadctl=""
json=""
timeout_s=0
mark=""
cmd=()

die() {
  echo "netns-topology: $*" >&2
  exit 1
}

sub="${1:-}"
[[ -n "$sub" ]] || die "usage: $0 check|up|down|counters|run|exec-rank [options] [-- CMD...]"
shift
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --ranks-per-node) per_node="$2"; shift 2 ;;
    --offloadctl) offloadctl="$2"; shift 2 ;;
    --json) json="$2"; shift 2 ;;
    --timeout-s) timeout_s="$2"; shift 2 ;;
    --mark) mark="$2"; shift 2 ;;
    --) shift; cmd=("$@"); break ;;
    *) die "unknown option '$1'" ;;
  esac
done
[[ ${#name} -le 12 && "$name" =~ ^[A-Za-z0-9_]+$ ]] ||
  die "--name '$name' must be 1..12 letters, digits or _ (interface names are <= 15 bytes)"

ns() { echo "${name}-n$1"; }
veth() { echo "${name}-v$1"; }
addr() { echo "10.213.0.$(($1 + 1))"; }

check() {
  command -v ip >/dev/null 2>&1 || { echo "no 'ip' command (iproute2)"; return 77; }
  command -v tc >/dev/null 2>&1 || { echo "no 'tc' command (iproute2)"; return 77; }
  [[ $(id -u) -eq 0 ]] || { echo "not root (network namespaces need CAP_NET_ADMIN)"; return 77; }
  local probe="${name}-probe" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "cannot create a network namespace: $err"
    return 77
  fi
  ip netns del "$probe" 2>/dev/null || true
  return 0
}

# Shapes one veth end: netem (delay and rate) when the kernel has it, else tbf (rate only).
shape() {
  local n="$1" dev="$2"
  if [[ "$rate" == "none" ]]; then
    echo "unshaped"
    return 0
  fi
  if ip netns exec "$n" tc qdisc add dev "$dev" root netem delay "$delay" rate "$rate" \
      limit 100000 2>/dev/null; then
    echo "netem delay $delay rate $rate"
  else
    ip netns exec "$n" tc qdisc add dev "$dev" root tbf rate "$rate" burst 256kb latency 100ms ||
      return 1
    echo "tbf rate $rate (no delay: this kernel has no sch_netem)"
  fi
}

down() {
  local k
  for k in 0 1; do
    ip netns del "$(ns $k)" 2>/dev/null || true  # removes its veth end and so the pair
  done
}

up() {
  local out
  out=$(check) || die "$out"
  if ip netns list | grep -q "^${name}-n[01]\b"; then die "topology '$name' already exists"; fi
  trap 'down' ERR
  ip netns add "$(ns 0)"
  ip netns add "$(ns 1)"
  ip link add "$(veth 0)" netns "$(ns 0)" type veth peer name "$(veth 1)" netns "$(ns 1)"
  local k
  for k in 0 1; do
    ip -n "$(ns $k)" link set lo up
    ip -n "$(ns $k)" addr add "$(addr $k)/24" dev "$(veth $k)"
    ip -n "$(ns $k)" link set "$(veth $k)" up
  done
  shaping=$(shape "$(ns 0)" "$(veth 0)")
  shape "$(ns 1)" "$(veth 1)" >/dev/null
  trap - ERR
  echo "netns-topology: '$name' up: $(ns 0) $(addr 0) <-> $(ns 1) $(addr 1), each way $shaping" >&2
}

counters() {
  local d="/sys/class/net/$(veth 0)/statistics"
  ip netns exec "$(ns 0)" sh -c "echo \$(cat $d/tx_bytes) \$(cat $d/rx_bytes)"
}

case "$sub" in
  check)
    check
    ;;
  up)
    up
    ;;
  down)
    down
    ;;
  counters)
    counters
    ;;
  exec-rank)
    [[ ${#cmd[@]} -gt 0 ]] || die "exec-rank: no command after --"
    : "${RANK:?exec-rank runs under offloadctl launch (RANK unset)}"
    : "${LOCAL_WORLD_SIZE:?LOCAL_WORLD_SIZE unset}"
    : "${STRATA_NETNS_NAME:?STRATA_NETNS_NAME unset (run sets it)}"
    name="$STRATA_NETNS_NAME"
    node=$((RANK / LOCAL_WORLD_SIZE))
    export STRATA_GLOO_HOSTNAME
    STRATA_GLOO_HOSTNAME=$(addr "$node")
    exec ip netns exec "$(ns "$node")" "${cmd[@]}"
    ;;
  run)
    [[ ${#cmd[@]} -gt 0 ]] || die "run: no command after --"
    [[ "$per_node" =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node '$per_node' must be >= 1"
    if [[ -z "$offloadctl" ]]; then
      here=$(cd "$(dirname "$0")/.." && pwd)
      if command -v offloadctl >/dev/null 2>&1; then
        offloadctl=offloadctl
      elif [[ -x "$here/build/tools/offloadctl" ]]; then
        offloadctl="$here/build/tools/offloadctl"
      else
        die "no offloadctl in PATH or build/; pass --offloadctl"
      fi
    fi
    rdzv=$(mktemp -d "${TMPDIR:-/tmp}/netns-rdzv.XXXXXX")
    marks="$rdzv/marks"  # outside the run folder launch makes and removes
    trap 'down; rm -rf "$rdzv"' EXIT
    trap 'exit 130' INT TERM
    up
    read -r tx0 rx0 < <(counters)
    t0=$(date +%s.%N)
    rc=0
    self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
    launch=("$offloadctl" launch -n $((2 * per_node)) --ranks-per-node "$per_node"
      --rdzv-dir "$rdzv" --timeout-s "$timeout_s" -- "$self" exec-rank -- "${cmd[@]}")
    if [[ -z "$mark" ]]; then
      STRATA_NETNS_NAME="$name" "${launch[@]}" || rc=$?
    else
      # stdout goes straight through (fd 3); stderr runs through the marker loop.
      : >"$marks"
      set +e
      {
        STRATA_NETNS_NAME="$name" "${launch[@]}" 2>&1 1>&3 3>&- |
          {
            ptx=$tx0 prx=$rx0
            while IFS= read -r line; do
              printf '%s\n' "$line" >&2
              if [[ "$line" =~ $mark ]]; then
                read -r ctx crx < <(counters)
                echo "netns-topology: mark: node0->node1 $((ctx - ptx)), node1->node0" \
                  "$((crx - prx)) bytes since the previous mark" >&2
                clean=$(printf '%s' "$line" | tr '\t"\\' '   ')  # JSON-safe
                printf '%s\t%d\t%d\n' "$clean" $((ctx - ptx)) $((crx - prx)) >>"$marks"
                ptx=$ctx prx=$crx
              fi
            done
          }
        rc=${PIPESTATUS[0]}
      } 3>&1
      set -e
    fi
    t1=$(date +%s.%N)
    read -r tx1 rx1 < <(counters)
    tx=$((tx1 - tx0))
    rx=$((rx1 - rx0))
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
    echo "netns-topology: inter-node bytes (veth $(veth 0), Ethernet frames): node0->node1 $tx," \
      "node1->node0 $rx, total $((tx + rx)) in $secs s; link: $shaping; exit $rc" >&2
    if [[ -n "$json" ]]; then
      {
        printf '{"tx_bytes": %d, "rx_bytes": %d, "seconds": %s, "link": "%s", "exit_code": %d' \
          "$tx" "$rx" "$secs" "$shaping" "$rc"
        printf ', "marks": ['
        sep=""
        if [[ -n "$mark" ]]; then
          while IFS=$'\t' read -r l mtx mrx; do
            printf '%s{"line": "%s", "tx_bytes": %d, "rx_bytes": %d}' "$sep" "$l" "$mtx" "$mrx"
            sep=", "
          done <"$marks"
        fi
        printf ']}\n'
      } >"$json"
    fi
    exit "$rc"
    ;;
  *)
    die "unknown subcommand '$sub' (check|up|down|counters|run|exec-rank)"
    ;;
esac
