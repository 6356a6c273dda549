#!/bin/sh
# The entry point of every container on the rack: it turns the interfaces Docker gave the container
# into rack ports, then execs the command. Each data network "rack<p>" (subnet
# $RACK_CABLE_NET.<p>.0/24; RACK_CABLE_NET=10.B is the project's, chosen by `docker/testbed.py up`,
# 10.77 if unset) is one cable from switch port p to one worker; Docker's address on it only tells
# which cable an interface is, and is removed, so that the cable carries nothing but rack traffic
# (10.201.0.0/24, as in lab/switchagg_lab/testbed/rack.py).
#
#   rack-entry.sh worker PORT CMD...      the cable of port PORT gets 02:5a:00:00:00:PORT and
#                                         10.201.0.PORT/24, checksum offload off; GLOO_SOCKET_IFNAME
#   rack-entry.sh soft-switch N CMD...    a Linux bridge over the N cables holds the aggregator
#                                         address 10.201.0.254 (the software aggregator's)
#   rack-entry.sh bmv2-switch N CMD...    the N cables stay bare; CMD gets "-i p@ifname" per port
#                                         (before its first "--")
#   rack-entry.sh hosts N CMD...          only the rack's names (as a worker gets them), then CMD
set -eu

role=$1
count=$2
shift 2

net=${RACK_CABLE_NET:-10.77}

# The interface whose Docker address is in $net.<port>.0/24.
cable() {
  ip -o -4 addr show | awk -v net="$net.$1." 'index($4, net) == 1 { print $2; exit }'
}

# The rack's addresses by name in /etc/hosts ($RACK_HOSTS_FILE), each also in its IPv4-mapped form:
# c10d's store names every client so (getnameinfo), and without an entry the lookup goes to a DNS
# server an internal network cannot reach: "The hostname of the client socket cannot be retrieved"
# from every rank. $1: the ports to name (the rack's aggregator is named too).
rack_hosts() {
  {
    echo "10.201.0.254 rack-aggregator"
    echo "::ffff:10.201.0.254 rack-aggregator"
    p=1
    while [ "$p" -le "$1" ]; do
      echo "10.201.0.$p rack-port$p"
      echo "::ffff:10.201.0.$p rack-port$p"
      p=$((p + 1))
    done
  } >>"${RACK_HOSTS_FILE:-/etc/hosts}"
}

bare() {  # $1: the interface; no Docker address, no checksum offload (bmv2 needs finished checksums)
  ip addr flush dev "$1"
  ethtool -K "$1" tx off rx off sg off >/dev/null 2>&1 || true
}

case $role in
worker)
  ifname=$(cable "$count")
  [ -n "$ifname" ] || { echo "rack-entry: no interface in $net.$count.0/24" >&2; exit 1; }
  bare "$ifname"
  ip link set dev "$ifname" address "$(printf '02:5a:00:00:00:%02x' "$count")"
  ip addr add "10.201.0.$count/24" dev "$ifname"
  export GLOO_SOCKET_IFNAME="$ifname"
  rack_hosts "${RACK_PORTS:-32}"
  echo "rack-entry: worker on switch port $count: $ifname 10.201.0.$count"
  exec "$@"
  ;;
hosts)
  rack_hosts "$count"
  exec "$@"
  ;;
soft-switch)
  ip link add br0 type bridge
  ip link set br0 address 02:5a:00:00:00:fe up
  ip addr add 10.201.0.254/24 dev br0
  port=1
  while [ "$port" -le "$count" ]; do
    ifname=$(cable "$port")
    [ -n "$ifname" ] || { echo "rack-entry: no interface for port $port" >&2; exit 1; }
    bare "$ifname"
    ip link set dev "$ifname" master br0
    echo "rack-entry: switch port $port = $ifname (bridge br0)"
    port=$((port + 1))
  done
  exec "$@"
  ;;
bmv2-switch)
  ports=""
  port=1
  while [ "$port" -le "$count" ]; do
    ifname=$(cable "$port")
    [ -n "$ifname" ] || { echo "rack-entry: no interface for port $port" >&2; exit 1; }
    bare "$ifname"
    ports="$ports -i $port@$ifname"
    echo "rack-entry: switch port $port = $ifname (bmv2)"
    port=$((port + 1))
  done
  # The port options go before the first "--" (what follows it is for the target, e.g. gRPC).
  n=$#
  inserted=""
  while [ "$n" -gt 0 ]; do
    arg=$1
    shift
    if [ "$arg" = "--" ] && [ -z "$inserted" ]; then
      # shellcheck disable=SC2086  # one word per option
      set -- "$@" $ports
      inserted=yes
    fi
    set -- "$@" "$arg"
    n=$((n - 1))
  done
  # shellcheck disable=SC2086
  [ -n "$inserted" ] || set -- "$@" $ports
  exec "$@"
  ;;
*)
  echo "rack-entry: unknown role $role" >&2
  exit 2
  ;;
esac
