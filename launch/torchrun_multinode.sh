#!/usr/bin/env bash
# The torchrun command for an N-node run without Slurm: run this same line on every node.
# It runs torchrun through `python -m pp_runtime.cli.agent`, which binds torchrun's two
# stores (the c10d rendezvous, the workers' bootstrap store) to MASTER_ADDR / LOCAL_ADDR
# instead of every interface (docs/distributed.md).
#
#   NNODES=2 NPROC_PER_NODE=8 MASTER_ADDR=10.0.0.1 CONFIG=my_tp8_pp2.yaml \
#       launch/torchrun_multinode.sh --set chunk_size=512        # on each of the 2 nodes
#   CONFIG=cpu/gpt2_pp2 launch/torchrun_multinode.sh              # one machine, 2 ranks, 127.0.0.1
#
# NNODES         nodes taking part (default 1)
# NPROC_PER_NODE ranks per node (default: the config's tp * pp / NNODES; set it when --set
#                changes tp or pp); one per GPU on GPU nodes
# MASTER_ADDR    IP address of the node hosting the c10d rendezvous, on the cluster network
#                (default 127.0.0.1: one machine, nothing reachable from outside)
# MASTER_PORT    its port (default 29500); open between the nodes, closed to the outside
# LOCAL_ADDR     this node's IP address on the cluster network, where its bootstrap store
#                listens if it gets rank 0 (default: the address it reaches MASTER_ADDR from)
# CONFIG         pp-runtime config, shipped name or YAML path (default cpu/gpt2_pp2)
# OUT            report directory (default: the launcher's)
# RDZV_ID        rendezvous id, the same on every node, different per run (default pp-runtime)
# IS_HOST        1 on the MASTER_ADDR node, 0 elsewhere, when torch cannot tell by itself
#                (MASTER_ADDR on a second NIC, e.g. InfiniBand)
# Further arguments go to `python -m pp_runtime.cli.torchrun` (--set FIELD=VALUE,
# --requests N, ...), which runs the config's workload; rank 0 writes the report.
# NCCL_* / GLOO_SOCKET_IFNAME are read from the environment: docs/slurm.md.
set -euo pipefail

NNODES=${NNODES:-1}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=${CONFIG:-cpu/gpt2_pp2}
RDZV_ID=${RDZV_ID:-pp-runtime}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    world=$(python -c 'import sys; from pp_runtime.config import load_config
p = load_config(sys.argv[1]).parallel; print(p.tp * p.pp)' "$CONFIG")
    if ((world % NNODES)); then
        echo "tp * pp = $world ranks do not split over $NNODES nodes; set NPROC_PER_NODE" >&2
        exit 2
    fi
    NPROC_PER_NODE=$((world / NNODES))
fi

args=(--nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --rdzv-backend=c10d
      --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID")
if [[ -n ${IS_HOST:-} ]]; then args+=(--rdzv-conf="is_host=$IS_HOST"); fi
if [[ -n ${LOCAL_ADDR:-} ]]; then args+=(--local-addr="$LOCAL_ADDR"); fi
launcher=(--config "$CONFIG")
if [[ -n ${OUT:-} ]]; then launcher+=(--out "$OUT"); fi
set -x
exec python -m pp_runtime.cli.agent "${args[@]}" -m pp_runtime.cli.torchrun "${launcher[@]}" "$@"
