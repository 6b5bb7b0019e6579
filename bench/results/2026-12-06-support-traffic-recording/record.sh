#!/bin/bash
# The recording of this directory: 772 support questions answered in German, in three parts appended to
# one recording (the 272 new questions, then the 500 recorded questions of 2026-12-06-draft-adaptation-support
# in two halves; each part's prompt ids are in new.txt, old_a.txt, old_b.txt). The int4 twin writes greedily,
# the float32 target scores (when this recording was made, each part moved the writer's own records,
# OUT.fast, aside before the next; bench/record_rescored.py now keeps them in a directory of their own).
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=bench/results/2026-12-06-support-traffic-recording
OUT=models/default-support.recording
for part in new old_a old_b; do
  if [ "$part" = new ]; then Q=$HERE/questions-more.jsonl; else Q=bench/results/2026-12-06-draft-adaptation-support/questions.jsonl; fi
  echo "== part $part $(date)"
  .venv/bin/python bench/record_rescored.py --fast models/default-int4 --bundle models/default \
     --prompts-file "$Q" --train "$(cat $HERE/$part.txt)" --out $OUT
done
