#!/usr/bin/env bash
# Runs a share of the unit tests on the TPU v5e test machine, in one process that holds the chip
# (TUNIX_NB_TEST_ON_ACCELERATOR=1: conftest.py leaves JAX on the TPU and skips the tests marked
# cpu_only). pyproject's addopts hold nbval's options and xdist's -n 2, so they are replaced.
# Each test's outcome goes to $OUT/unit_tests_CHUNK.log as it finishes, so a call cut short by its
# 10-minute limit still says how far it got; JUnit XML and the summary line follow at the end.
# live_report.py writes each failure's report as it happens, to $OUT/unit_tests_failures_CHUNK.txt.
# Usage: bash results/unit_tests_tpu/run_chunk.sh CHUNK_NAME tests/test_a.py tests/test_b.py ...
# (or @FILE, a file of test paths and node ids, one a line)
chunk="$1"; shift
source results/lesson_runs/tpu_setup.sh
export TUNIX_NB_TEST_ON_ACCELERATOR=1 CHUNK="$chunk" PYTHONPATH="$PYTHONPATH:$PWD/results/unit_tests_tpu"
timeout "${TEST_SECONDS:-540}" python -m pytest -o addopts="" -p no:cacheprovider -p live_report -v -rfE \
    --junitxml "$OUT/unit_tests_$chunk.xml" "$@" > "$OUT/unit_tests_$chunk.log" 2>&1
echo "exit $?" >> "$OUT/unit_tests_$chunk.log"
tail -n 3 "$OUT/unit_tests_$chunk.log"
