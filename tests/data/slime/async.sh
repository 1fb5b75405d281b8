# The seed's "Workflow 2: Asynchronous Training" command line, verbatim (its model script
# is the one of the seed's Workflow 1, step 2).
source scripts/models/qwen3-4B.sh

python train_async.py \
    --actor-num-nodes 1 \
    --actor-num-gpus-per-node 8 \
    --rollout-num-gpus 8 \
    --advantage-estimator grpo \
    --async-buffer-size 4 \
    --prompt-data /path/to/train.jsonl \
    ${MODEL_ARGS[@]}
