#!/usr/bin/env bash
# The master_weights A/B on a GPU machine (docs/performance.md), at most 7 minutes in all:
# train.py's master_weights against autocast (dev/gpu_ab.py's master variants) at 4096 and 25000
# tokens, with and without CUDA graphs; train.py with both on Multi30k; dev/test_gpu.py's torchrun
# tests. The data first:
#     python data_prep.py multi30k --src en --tgt de --out .gpu_data/multi30k_en_de
#     bash dev/gpu_call.sh [DATA_DIR]           # default: the root's .gpu_data/multi30k_en_de
#     OUT=logs bash dev/gpu_call.sh [DATA_DIR]  # the logs in logs/ (default: a temporary folder)
# Each stage has its own time limit; its log lands in $OUT, and summary.txt sums them up.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# absolute paths: the stages run from the repository root
DATA=$(realpath -m "${1:-$ROOT/.gpu_data/multi30k_en_de}")
OUT=$(realpath -m "${OUT:-$(mktemp -d)}")
cd "$ROOT"
RUNS=$(mktemp -d)  # train.py's checkpoints: thrown away
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# stage NAME SECONDS COMMAND...: its output to $OUT/NAME.log, its time and status to summary.txt
stage() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s (limit $limit)" | tee -a "$OUT/summary.txt"
}
stage device 15 sh -c 'nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
    python3 -c "import torch; print(torch.__version__)"; git log --oneline -1'
stage ab_4096 125 python3 dev/gpu_ab.py --variants padded,master,graphs,graphs-master \
    --batch-tokens 4096 --profile
stage ab_25000 90 python3 dev/gpu_ab.py --variants padded,master --batch-tokens 25000
T="config/wmt_base.py --data_dir=$DATA --max_tokens=4096 --compile=True --cuda_graphs=True
   --max_steps=200 --log_interval=50 --eval_interval=0 --bleu_interval=-1 --save_interval=0
   --overwrite=True"
for m in False True; do
    stage "train_master_$m" 60 python3 train.py $T --master_weights=$m --out_dir="$RUNS/run"
done
stage tests 60 python3 -m pytest -q -p no:cacheprovider dev/test_gpu.py -k nccl
grep -h -E "ms/step|^step (100|200) |valid_loss|passed|failed" "$OUT"/*.log \
    | tee -a "$OUT/summary.txt"
echo "logs and summary.txt in $OUT"
