#!/usr/bin/env bash
# The next device call for the GPU issue (docs/performance.md, "The next GPU call"), at most 420 s in all:
# train.py's master_weights against autocast (docs/gpu_ab.py's master variants) at 4096 and 25000 tokens,
# with and without CUDA graphs; train.py with both on Multi30k; the GPU tests not yet run on a GPU.
# Prepared on the CPU: python data_prep.py multi30k --src en --tgt de --out .gpu_data/multi30k_en_de
# The call (device tool): command `bash docs/gpu_call.sh`, carry [".gpu_data"], timeout_s 420.
# Each stage has its own time limit; its log lands in $OUT (the device tool's folder, else a temporary one).
set -u
OUT=${OUT:-$(mktemp -d)}
RUNS=$(mktemp -d)  # train.py's checkpoints: not brought back
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stage() {  # stage NAME SECONDS COMMAND...: its output to $OUT/NAME.log, its time and status to summary.txt
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s (limit $limit)" | tee -a "$OUT/summary.txt"
}
stage device 15 sh -c 'nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
    python3 -c "import torch; print(torch.__version__)"; git log --oneline -1'
stage ab_4096 125 python3 docs/gpu_ab.py --variants padded,master,graphs,graphs-master --batch-tokens 4096 \
    --profile
stage ab_25000 90 python3 docs/gpu_ab.py --variants padded,master --batch-tokens 25000
T="config/wmt_base.py --data_dir=.gpu_data/multi30k_en_de --max_tokens=4096 --compile=True --cuda_graphs=True
   --max_steps=200 --log_interval=50 --eval_interval=0 --bleu_interval=-1 --save_interval=0 --overwrite=True"
for m in False True; do
    stage "train_master_$m" 60 python3 train.py $T --master_weights=$m --out_dir="$RUNS/run"
done
stage tests 60 python3 -m pytest -q -p no:cacheprovider test_gpu.py -k nccl
grep -h -E "ms/step|^step (100|200) |valid_loss|passed|failed" "$OUT"/*.log | tee -a "$OUT/summary.txt"
echo "logs and summary.txt in $OUT"
