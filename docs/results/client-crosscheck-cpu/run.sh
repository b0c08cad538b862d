#!/bin/bash
# one server, the same 32 prompts, 64 output tokens (EOS ignored), concurrency 4;
# SGLang's bench_serving and harness bench alternately, 3 times each
# needs: SGLANG=<a folder with `pip install --no-deps --target DIR sglang==0.4.6.post5` and
# `pip install --target DIR aiohttp`>, and our DFlash server on port 18600:
#   python -m reference_engine.serve --model reference_engine/assets/demo/target \
#     --dflash-draft-model-path reference_engine/assets/demo/draft --block-size 8 \
#     --dtype float32 --max-num-seqs 8 --port 18600 --served-model-name demo
set -e
D=docs/results/client-crosscheck-cpu
OUT=${OUT:-results/client-crosscheck}
mkdir -p $OUT
for r in 0 1 2; do
  PYTHONPATH=$SGLANG HF_HUB_OFFLINE=1 python3 -m sglang.bench_serving --backend vllm \
    --base-url http://127.0.0.1:18600 --model demo \
    --tokenizer reference_engine/assets/demo/target --dataset-name sharegpt \
    --dataset-path $D/sharegpt.json --sharegpt-output-len 64 --num-prompts 32 \
    --max-concurrency 4 --request-rate inf --seed 1 --output-file $OUT/sglang.jsonl \
    > $OUT/sglang-$r.txt 2>&1
  python3 -m harness bench --base-url http://127.0.0.1:18600 --model demo --dataset $D/prompts.jsonl \
    --num-prompts 32 --output-len 64 --concurrency 4 --warmup 1 --repeats 1 --label harness-$r \
    --out $OUT/harness > $OUT/harness-$r.txt 2>&1
done
