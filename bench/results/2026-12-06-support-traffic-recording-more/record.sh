#!/bin/bash
# More of the support assistant's traffic: questions none of the earlier 787 repeat, written by the int4
# bundle's model, then answered in German greedily by the int4 twin and scored by the float32 target into
# a recording of their own (gzipped here as traffic.jsonl.gz; append it to the 772 generations of
# 2026-12-06-support-traffic-recording to adapt on both).
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=bench/results/2026-12-06-support-traffic-recording-more
OUT=models/default-support-more.recording
.venv/bin/python bench/write_questions.py --domain internet-support --per-call 4 --seed 2 --first-id 22001 \
   --avoid bench/results/2026-12-06-draft-adaptation-support/questions.jsonl \
   --avoid bench/results/2026-12-06-support-traffic-recording/questions-more.jsonl \
   --out $HERE/questions.jsonl 2>&1 | tee $HERE/write_questions.log
n=$(wc -l < $HERE/questions.jsonl)          # every question just written
.venv/bin/python bench/record_rescored.py --fast models/default-int4 --bundle models/default \
   --prompts-file $HERE/questions.jsonl --train "de:first-$n" --out $OUT 2>&1 | tee $HERE/record.log
gzip -c $OUT/traffic.jsonl > $HERE/traffic.jsonl.gz
