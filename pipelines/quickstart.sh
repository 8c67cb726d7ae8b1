#!/usr/bin/env bash
# The quickstart (pipelines/quickstart.yaml) as plain CLI calls, for users who script rather than write YAML.
#
#   bash pipelines/quickstart.sh                 # one launcher, 2 training processes
#   NODES=2 bash pipelines/quickstart.sh         # two launchers on this machine as nodes 0 and 1 of one job
#                                                # (rendezvous on 127.0.0.1), one training process each
#
# Settings by environment: RUN_DIR (runs/quickstart-sh), PORT (8765), STEPS (300), NUM_CONCEPTS (2000),
# HEADS (cliptk-small: the heads' width), NOTO_VERSION (16.0.0). Every stage resumes or skips finished work
# when run again, like the YAML pipeline; the towers' features of the OpenMoji images are cached in
# RUN_DIR/tower_cache.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLKIT=${TOOLKIT:-.venv/bin/toolkit}
RUN_DIR=${RUN_DIR:-runs/quickstart-sh}
PORT=${PORT:-8765}
STEPS=${STEPS:-300}
NUM_CONCEPTS=${NUM_CONCEPTS:-2000}
HEADS=${HEADS:-cliptk-small}
NOTO_VERSION=${NOTO_VERSION:-16.0.0}
NODES=${NODES:-1}
SETS="$RUN_DIR/evalsets"
CACHE="$RUN_DIR/tower_cache"

# 1. Serve the demo folder on 127.0.0.1 (stopped when this script exits), so fetch downloads over HTTP.
mkdir -p "$RUN_DIR/demo"
"$TOOLKIT" data serve "$RUN_DIR/demo" --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT

# 2. Data: a second training artist from npm (Google's Noto emoji, Apache-2.0) when npm is installed; the
#    demo's URL lists -> raw webdataset shards -> the frozen towers' features (LiT training shards).
NOTO="$RUN_DIR/npm_artist/emoji-datasource-google-$NOTO_VERSION.tgz"
if [ ! -f "$NOTO" ] && command -v npm >/dev/null 2>&1; then
  mkdir -p "$RUN_DIR/npm_artist"
  npm pack --silent --pack-destination "$RUN_DIR/npm_artist" "emoji-datasource-google@$NOTO_VERSION" >/dev/null
fi
[ -f "$NOTO" ] || echo "npm not found: training on Twemoji alone (held-out R@1 about 9% instead of 10+%)" >&2
"$TOOLKIT" data demo --out "$RUN_DIR/demo" --limit "$NUM_CONCEPTS" --base-url "http://127.0.0.1:$PORT/" \
  --set "extra_artists=[\"$NOTO\"]" --set missing_ok=true
TRAIN_URLS="$RUN_DIR/demo/train_urls.csv"; [ -f "$NOTO" ] || TRAIN_URLS="$RUN_DIR/demo/twemoji_urls.csv"
"$TOOLKIT" data fetch --urls "$TRAIN_URLS" --out "$RUN_DIR/raw" --image-size 224 \
  --samples-per-shard 500 --threads 8
"$TOOLKIT" data precompute --in "$RUN_DIR/raw" --out "$RUN_DIR/train_data" --model "$HEADS" --samples-per-shard 500 \
  --image-tower efficientnet_lite0 --text-tower minilm

# 3. Evaluation sets: the same concepts drawn by OpenMoji (the held-out artist): retrieval and emoji groups.
"$TOOLKIT" eval build-set --source openmoji --task retrieval --input "$RUN_DIR/demo" --out "$SETS/openmoji_retrieval"
"$TOOLKIT" eval build-set --source openmoji --input "$RUN_DIR/demo" --out "$SETS/openmoji_groups"
DATASETS=openmoji_retrieval,openmoji_groups

# 4. Train the two heads with FastCLIP-v3: 2 processes under one launcher, or one per node with NODES=2;
#    held-out retrieval every 100 steps (the towers run over the OpenMoji images once, then from the cache).
TRAIN=(train --data "$RUN_DIR/train_data" --out "$RUN_DIR/train" --model "$HEADS" --loss fastclip-v3
       --mode fastclip --batch-size 256 --steps "$STEPS" --lr 1e-3 --workers 0 --log-every 10
       --checkpoint-every 0 --eval-every 100 --eval-root "$SETS" --eval-datasets openmoji_retrieval
       --set optim.warmup_steps=25 --set tensorboard=false --set eval.feature_cache="$CACHE")
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

# 5. Zero-shot scores of the trained model (chance level beside each number; gallery and curves as PNGs).
"$TOOLKIT" eval zeroshot --model "$RUN_DIR/train/model" --datasets "$DATASETS" --root "$SETS" --device cpu \
  --out "$RUN_DIR/zeroshot" --set feature_cache="$CACHE" --set training_run="$RUN_DIR/train"
echo "report: $RUN_DIR/zeroshot/report.md"
