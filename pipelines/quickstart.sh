#!/usr/bin/env bash
# The quickstart (pipelines/quickstart.yaml) as plain CLI calls, for users who script rather than write YAML.
#
#   bash pipelines/quickstart.sh                 # one launcher, 2 training processes
#   NODES=2 bash pipelines/quickstart.sh         # two launchers on this machine as nodes 0 and 1 of one job
#                                                # (rendezvous on 127.0.0.1), one training process each
#
# Settings by environment: RUN_DIR (runs/quickstart-sh), PORT (8765), STEPS (500), NUM_CONCEPTS (2000),
# MODEL (cliptk-tiny), FASHION_MNIST (/usr/share/datasets/fashion-mnist). Every stage resumes or skips
# finished work when run again, like the YAML pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLKIT=${TOOLKIT:-.venv/bin/toolkit}
RUN_DIR=${RUN_DIR:-runs/quickstart-sh}
PORT=${PORT:-8765}
STEPS=${STEPS:-500}
NUM_CONCEPTS=${NUM_CONCEPTS:-2000}
MODEL=${MODEL:-cliptk-tiny}
NODES=${NODES:-1}
FASHION_MNIST=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
SETS="$RUN_DIR/evalsets"

# 1. Serve the demo folder on 127.0.0.1 (stopped when this script exits), so fetch downloads over HTTP.
mkdir -p "$RUN_DIR/demo"
"$TOOLKIT" data serve "$RUN_DIR/demo" --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT

# 2. Data: the demo's URL lists -> raw webdataset shards -> training shards for MODEL.
"$TOOLKIT" data demo --out "$RUN_DIR/demo" --limit "$NUM_CONCEPTS" --base-url "http://127.0.0.1:$PORT/"
"$TOOLKIT" data fetch --urls "$RUN_DIR/demo/twemoji_urls.csv" --out "$RUN_DIR/raw" --image-size 64 \
  --samples-per-shard 500 --threads 8
"$TOOLKIT" data precompute --in "$RUN_DIR/raw" --out "$RUN_DIR/train_data" --model "$MODEL" --samples-per-shard 500

# 3. Evaluation sets: the same concepts drawn by OpenMoji (held-out artist), and Fashion-MNIST if installed.
"$TOOLKIT" eval build-set --source openmoji --task retrieval --input "$RUN_DIR/demo" --out "$SETS/openmoji_retrieval"
"$TOOLKIT" eval build-set --source openmoji --input "$RUN_DIR/demo" --out "$SETS/openmoji_groups"
"$TOOLKIT" eval build-set --source fashion-mnist --input "$FASHION_MNIST" --limit 2000 --missing-ok \
  --out "$SETS/fashion_mnist"
DATASETS=openmoji_retrieval,openmoji_groups,fashion_mnist
"$TOOLKIT" eval zeroshot --model "$MODEL" --datasets "$DATASETS" --skip-missing --root "$SETS" --device cpu \
  --out "$RUN_DIR/baseline" > /dev/null

# 4. Train with FastCLIP-v3: 2 processes under one launcher, or one per node with NODES=2.
TRAIN=(train --data "$RUN_DIR/train_data" --out "$RUN_DIR/train" --model "$MODEL" --loss fastclip-v3
       --mode fastclip --batch-size 64 --steps "$STEPS" --workers 1 --log-every 25 --checkpoint-every 100)
if [ "$NODES" = 1 ]; then
  "$TOOLKIT" "${TRAIN[@]}" --nproc-per-node 2
else
  TRAIN_PORT=$((PORT + 1))
  "$TOOLKIT" --quiet "${TRAIN[@]}" --nproc-per-node 1 --nodes 2 --node-rank 1 --master-addr 127.0.0.1 \
    --master-port "$TRAIN_PORT" &
  NODE1=$!
  "$TOOLKIT" "${TRAIN[@]}" --nproc-per-node 1 --nodes 2 --node-rank 0 --master-addr 127.0.0.1 \
    --master-port "$TRAIN_PORT"
  wait "$NODE1"
fi

# 5. Zero-shot scores of the trained model (the table has the chance level beside each number).
"$TOOLKIT" eval zeroshot --model "$RUN_DIR/train/model" --datasets "$DATASETS" --skip-missing --root "$SETS" \
  --device cpu --out "$RUN_DIR/zeroshot"
echo "before training: $RUN_DIR/baseline/report.md"
