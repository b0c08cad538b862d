#!/bin/bash
# One server, one workload, four clients, once each: harness bench, vLLM's bench serve, SGLang's
# bench_serving and guidellm. The 32 prompts of ../client-crosscheck-cpu, 64 output tokens each
# (EOS ignored, temperature 0), at most 4 requests in flight, all sent at once. Needs the clients
# in .peers/ (make setup) and our DFlash server on port 18611:
#   python -m reference_engine.serve --model reference_engine/assets/demo/target \
#     --dflash-draft-model-path reference_engine/assets/demo/draft --block-size 8 \
#     --dtype float32 --max-num-seqs 8 --threads 1 --port 18611 --served-model-name demo
set -e
D=docs/results/client-crosscheck-cpu
R=docs/results/peer-clients-cpu
OUT=${OUT:-results/peer-clients}
URL=http://127.0.0.1:18611
TOK=reference_engine/assets/demo/target
mkdir -p $OUT
peer() { PYTHONPATH=.peers HF_HUB_OFFLINE=1 python3 "$@"; }
VLLM='
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))'
cat /proc/loadavg >$OUT/loadavg-before.txt
python3 -m harness bench --base-url $URL --model demo --dataset $D/prompts.jsonl --num-prompts 32 \
  --output-len 64 --concurrency 4 --warmup 1 --repeats 1 --label harness --out $OUT/harness \
  >$OUT/harness.txt 2>&1
# vLLM's own parser and main (its CLI's entry point imports server modules the client does not need)
peer -c "$VLLM" --backend vllm --base-url $URL --model demo \
  --tokenizer $TOK --dataset-name sharegpt --dataset-path $D/sharegpt.json --sharegpt-output-len 64 \
  --num-prompts 32 --max-concurrency 4 --request-rate inf --temperature 0 --ignore-eos --seed 1 \
  --save-result --result-dir $OUT --result-filename vllm.json >$OUT/vllm.txt 2>&1
peer -m sglang.bench_serving --backend vllm --base-url $URL --model demo --tokenizer $TOK \
  --dataset-name sharegpt --dataset-path $D/sharegpt.json --sharegpt-output-len 64 --num-prompts 32 \
  --max-concurrency 4 --request-rate inf --seed 1 --output-file $OUT/sglang.jsonl >$OUT/sglang.txt 2>&1
python3 -c "
import json
for line in open('$D/prompts.jsonl'):
    print(json.dumps({'prompt': json.loads(line)['prompt'], 'output_tokens_count': 64}))
" >$OUT/guidellm-data.jsonl
sed "s#@URL@#$URL#; s#@TOK@#$TOK#; s#@DATA@#$OUT/guidellm-data.jsonl#; s#@REPORT@#$OUT/guidellm.json#" \
  $R/guidellm-scenario.json >$OUT/guidellm-scenario.json
peer -m guidellm run -c $OUT/guidellm-scenario.json --disable-console-interactive >$OUT/guidellm.txt 2>&1
cat /proc/loadavg >$OUT/loadavg-after.txt
