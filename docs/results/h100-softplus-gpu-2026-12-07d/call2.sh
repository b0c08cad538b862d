#!/bin/bash
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 200 python3 .prof/dev/softplus_ab.py 2>&1 | tee $OUT/softplus_ab.log
