# Shared by slurm.sbatch and ssh.sh (sourced, not run): start the Ray nodes with their roles, wait
# for them, convert the HF checkpoint once, submit `megatron-rl train`, stop Ray at the end.
# The scripts only say *how to reach* a node (srun or ssh) through the function `on_node NODE CMD`
# they define; everything else is here. docs/production.md walks through it.
#
# Inputs (environment; the scripts set defaults):
#   RECIPE          the run's recipe (e.g. examples/llama4_scout/<recipe>.yaml)
#   HF_CHECKPOINT   the HF model folder (shared filesystem, readable from every node)
#   OUTPUT_DIR      the run directory (shared filesystem): logs, TensorBoard, checkpoints
#   TRAINER_NODES / GENERATOR_NODES   hostnames, space-separated; the first trainer node is the
#                   Ray head and runs the driver (this script must run there)
#   GPUS_PER_NODE   GPUs Ray offers on each node
#   RAY_PORT        the head's GCS port (6379)
#   HEAD_ADDRESS    the head's IP as the other nodes reach it (default: its first `hostname -I`;
#                   set it where that is not the cluster network)
#   MRL_SETUP       shell run first on every node (e.g. "source /opt/venv/bin/activate" or
#                   "cd /opt/megatron_rl"); megatron-rl, ray and python must then be on PATH
#   MRL_REPO        this repository's path on every node (shared filesystem or the image's copy)

set -euo pipefail
: "${RECIPE:?set RECIPE to the recipe yaml of the run}"
: "${HF_CHECKPOINT:?set HF_CHECKPOINT to the HF model folder (shared filesystem)}"
: "${OUTPUT_DIR:?set OUTPUT_DIR to the run directory (shared filesystem)}"
: "${TRAINER_NODES:?set TRAINER_NODES (hostnames)}"
: "${GENERATOR_NODES:?set GENERATOR_NODES (hostnames)}"
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
RAY_PORT=${RAY_PORT:-6379}
MRL_SETUP=${MRL_SETUP:-true}
MRL_REPO=${MRL_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}

read -r -a _TRAINERS <<< "$TRAINER_NODES"
read -r -a _GENERATORS <<< "$GENERATOR_NODES"
HEAD_NODE=${_TRAINERS[0]}
NUM_NODES=$(( ${#_TRAINERS[@]} + ${#_GENERATORS[@]} ))

# The role of a node is a custom Ray resource with one unit per GPU
# (megatron_rl/cluster/placement.py: trainer ranks ask for megatron_rl_trainer, engines for
# megatron_rl_generator), so Ray places each actor only on nodes of its role.
role_resources() {  # ROLE -> the --resources JSON
  echo "{\"megatron_rl_$1\": $GPUS_PER_NODE}"
}

head_address() {  # the head's address as the other nodes reach it (HEAD_ADDRESS overrides)
  if [[ -n "${HEAD_ADDRESS:-}" ]]; then
    echo "$HEAD_ADDRESS"
  else
    on_node "$HEAD_NODE" "hostname -I | awk '{print \$1}'" | tail -n 1
  fi
}

ray_start() {  # NODE "ray start" ARGUMENTS
  if [[ "${RAY_START_BLOCK:-0}" == 1 ]]; then
    # SLURM ends a job step's processes with the step: keep one step per node open (--block).
    on_node "$1" "$MRL_SETUP && ray start $2 --block" &
  else  # ssh: `ray start` leaves its daemons running and returns
    on_node "$1" "$MRL_SETUP && ray start $2"
  fi
}

wait_for_nodes() {  # COUNT: until COUNT nodes have joined (prints each node's role)
  (eval "$MRL_SETUP" && python "$MRL_REPO/examples/launch/wait_for_nodes.py" \
      --address "$RAY_ADDRESS_OF_RUN" --nodes "$1" --timeout 600)
}

start_ray() {
  local node gpus="--num-gpus=$GPUS_PER_NODE --disable-usage-stats"
  RAY_ADDRESS_OF_RUN="$(head_address):$RAY_PORT"
  echo "launch: Ray head $RAY_ADDRESS_OF_RUN on $HEAD_NODE (trainer role), $NUM_NODES nodes"
  ray_start "$HEAD_NODE" "--head --port=$RAY_PORT $gpus --resources='$(role_resources trainer)'"
  wait_for_nodes 1
  for node in "${_TRAINERS[@]:1}"; do
    ray_start "$node" "--address=$RAY_ADDRESS_OF_RUN $gpus \
        --resources='$(role_resources trainer)'" &
  done
  for node in "${_GENERATORS[@]}"; do
    ray_start "$node" "--address=$RAY_ADDRESS_OF_RUN $gpus \
        --resources='$(role_resources generator)'" &
  done
  [[ "${RAY_START_BLOCK:-0}" == 1 ]] || wait  # ssh: the starts return once the node is up
  # Placement is decided at once when the run starts: every node must have joined.
  wait_for_nodes "$NUM_NODES"
}

stop_ray() {  # every node, also after a failure (trap)
  local node
  for node in "${_TRAINERS[@]}" "${_GENERATORS[@]}"; do
    on_node "$node" "$MRL_SETUP && ray stop --force" >/dev/null 2>&1 &
  done
  wait
}

convert_checkpoint() {
  # `megatron-rl train` converts model.hf_checkpoint into OUTPUT_DIR/start_checkpoint when that
  # is missing; converting here first (on the head's CPUs, with --validate) fails before any GPU
  # is reserved if the checkpoint is damaged, and the run then finds it done.
  if [[ -f "$OUTPUT_DIR/start_checkpoint/metadata.json" ]]; then
    echo "launch: $OUTPUT_DIR/start_checkpoint exists (converted before)"
    return
  fi
  mkdir -p "$OUTPUT_DIR"
  (eval "$MRL_SETUP" && python "$MRL_REPO/tools/convert_hf_to_megatron.py" "$HF_CHECKPOINT" \
      "$OUTPUT_DIR/start_checkpoint" --validate --overwrite)
}

submit_run() {  # extra arguments: more section.field=value overrides
  echo "launch: driver log here; generator logs $OUTPUT_DIR/generator-*.log; processes" \
       "$OUTPUT_DIR/processes.json; TensorBoard: tensorboard --logdir $OUTPUT_DIR/tensorboard;" \
       "Ray logs /tmp/ray/session_latest/logs on each node"
  (eval "$MRL_SETUP" && cd "$MRL_REPO" && megatron-rl train "$RECIPE" \
      "cluster.address=$RAY_ADDRESS_OF_RUN" "model.hf_checkpoint=$HF_CHECKPOINT" \
      "output_dir=$OUTPUT_DIR" "$@")
}
