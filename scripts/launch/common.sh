# shellcheck shell=bash
# Helpers shared by the launch scripts (sourced, not run): argument checks, the per-node
# environment, and --dry-run printing.
#
# A node's launch is two arrays, NODE_ENV (KEY=VALUE entries) and NODE_CMD (the command and its
# arguments). launch_node prints them (--dry-run) or runs the command with that environment.

die() {
    echo "error: $*" >&2
    exit 2
}

# need VALUE NAME: fail with the option's name when a required value is empty.
need() {
    [[ -n "$1" ]] || die "$2 is required (see --help)"
}

# positive_int VALUE NAME
positive_int() {
    [[ "$1" =~ ^[1-9][0-9]*$ ]] || die "$2 must be a positive integer, got '$1'"
}

# device_list N: "0,1,...,N-1", the devices one node exposes to its ranks.
device_list() {
    local n=$1 i out=""
    for ((i = 0; i < n; i++)); do
        out+="${out:+,}$i"
    done
    echo "$out"
}

# split_nodes "a,b,c": fills the array NODES.
split_nodes() {
    IFS=',' read -r -a NODES <<<"$1"
    ((${#NODES[@]} > 0)) || die "--nodes lists no host"
}

# this_node_rank: index of this host in NODES (hostname, short or full), or dies.
this_node_rank() {
    local i short full
    short=$(hostname -s 2>/dev/null || hostname)
    full=$(hostname -f 2>/dev/null || hostname)
    for i in "${!NODES[@]}"; do
        if [[ "${NODES[$i]}" == "$short" || "${NODES[$i]}" == "$full" ]]; then
            echo "$i"
            return
        fi
    done
    die "this host ($short) is not in --nodes ${NODES[*]}; pass --node-rank"
}

# quote WORD: WORD as the shell reads it back - bare when it is plain, else single-quoted.
quote() {
    if [[ "$1" =~ ^[A-Za-z0-9_./:,=@%+-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

# launch_node TITLE: print (DRY_RUN=1) or run NODE_CMD under NODE_ENV.
launch_node() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "### $1"
        local kv word line=""
        for kv in "${NODE_ENV[@]}"; do
            echo "export ${kv%%=*}=$(quote "${kv#*=}")"
        done
        for word in "${NODE_CMD[@]}"; do
            line+="${line:+ }$(quote "$word")"
        done
        printf '%s\n\n' "$line"
        return
    fi
    env "${NODE_ENV[@]}" "${NODE_CMD[@]}"
}

# ascend_env NPROC: the CANN and HCCL settings every Ascend rank needs, appended to NODE_ENV.
# CANN's set_env.sh must have been sourced (ASCEND_TOOLKIT_HOME set) on the node itself.
ascend_env() {
    NODE_ENV+=(
        "ASCEND_RT_VISIBLE_DEVICES=$(device_list "$1")"
        "HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}"
        "HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1200}"
        "CUDA_DEVICE_MAX_CONNECTIONS=1"
    )
    if [[ -n "${RANK_TABLE_FILE:-}" ]]; then
        NODE_ENV+=("RANK_TABLE_FILE=$RANK_TABLE_FILE")
    fi
}

# cuda_env NPROC: the NCCL settings, appended to NODE_ENV.
cuda_env() {
    NODE_ENV+=(
        "CUDA_VISIBLE_DEVICES=$(device_list "$1")"
        "CUDA_DEVICE_MAX_CONNECTIONS=1"
        "NCCL_DEBUG=${NCCL_DEBUG:-WARN}"
    )
    if [[ -n "${NCCL_SOCKET_IFNAME:-}" ]]; then
        NODE_ENV+=("NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME")
    fi
}
