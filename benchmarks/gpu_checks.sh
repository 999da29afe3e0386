#!/usr/bin/env bash
# Every check that needs a GPU, in one call on a lent device machine (issue 37: `pytest -m gpu` on CUDA and
# the 25.6M char-LM at >= 0.9x plain torch's tokens/s with one worker; issue 38: that model's loss at equal
# tokens with 1 and 4 workers against plain torch's).  Device time is short, so it is one prepared script:
#
#   bash ../shared/gpu/prepare.sh                      # here, first: the wheels the device lacks, into .device/
#   device run, carry [".device"], timeout 540:        bash .device/run.sh bash benchmarks/gpu_checks.sh
#
# It prints the gpu tests' summary, then utilization.py's table (plain torch once, then vcdask with 1 worker
# in the default mode and in the waiting mode of before issue 37, and with 4 workers sharing the GPU).
# Estimated from the H100 numbers of ../shared/gpu/README.md (torch 190k tokens/s on 4.2M tokens): the tests
# about a minute, the table 5-6 minutes.  `bash benchmarks/gpu_checks.sh --tests` runs the tests alone.
set -u -o pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -25
[ "${1:-}" = "--tests" ] && exit 0
python3 benchmarks/utilization.py --device cuda --d-model 512 --layers 8 --heads 8 --context 256 \
    --batch 64 --train-kb 2048 --shards 8 --epochs 2 --workers 1,4 --variants delta,wait 2>&1 | tail -40
