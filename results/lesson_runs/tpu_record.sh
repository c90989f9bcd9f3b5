#!/usr/bin/env bash
# Runs lessons on the TPU v5e test machine, one fresh process each, into $OUT/tpu_NN.json,
# with a profile of every cell of 5 s or more and the tail of each lesson's log in $OUT/tails.log
# (a call returns at most 8 files). The machine has no .git: the commit comes as an argument.
# Usage: bash results/lesson_runs/tpu_record.sh COMMIT NN [NN ...]
commit="$1"; shift
source results/lesson_runs/tpu_setup.sh
for lesson in "$@"; do
    python -m tunix_nb.lessons run "$lesson" --out "$OUT/tpu_$lesson.json" --commit "$commit" \
        --timeout 300 --profile 5 --logs "$OUT/logs_$lesson" > /dev/null 2>&1
    echo "== lesson $lesson: exit $?" >> "$OUT/tails.log"
    tail -c 2500 "$OUT"/logs_"$lesson"/*.log >> "$OUT/tails.log" 2>&1
    rm -rf "$OUT/logs_$lesson"
done
