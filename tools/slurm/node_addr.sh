#!/usr/bin/env bash
# Print this node's IPv4 address on the inter-node network (used by tools/slurm/*.sh).
# NET_IFACE set (e.g. ib0, eth1): that interface's address. Otherwise the first address of
# `hostname -I`, which on a multi-homed node may be the management network: set NET_IFACE
# there. The node's hostname is never resolved (it may not name the fast network at all).
set -euo pipefail
if [ -n "${NET_IFACE:-}" ]; then
  addr=$(ip -o -4 addr show dev "$NET_IFACE" | awk '{split($4, a, "/"); print a[1]; exit}')
else
  addr=$(hostname -I | awk '{print $1}')
fi
if [ -z "$addr" ]; then
  echo "node_addr.sh: no IPv4 address on ${NET_IFACE:-any interface} of $(hostname)" >&2
  exit 1
fi
echo "$addr"
