#!/usr/bin/env bash
# What a child process costs on this machine: the wall seconds of `python -c "import jax"` on the
# CPU, and of one short run of the training command in a CPU child (lesson 05's kind of cell), the
# median of three each. Run it on the 2-core CPU and on the TPU machine (after tpu_setup.sh) to see
# whether lesson 05's slower children there come from the machine (gVisor) or from the kit.
# Usage: bash results/lesson_runs/child_cost.sh > results/lesson_runs/child_cost/MACHINE.json
set -e -o pipefail
export JAX_PLATFORMS=cpu
dir=$(mktemp -d)
time_it() {  # prints the median wall seconds of three runs of "$@"
    for _ in 1 2 3; do
        start=$(date +%s.%N)
        "$@" > /dev/null 2>"$dir/err" || { echo "child_cost: '$*' failed: $(tail -3 "$dir/err")" >&2; exit 1; }
        end=$(date +%s.%N)
        echo "$end - $start" | bc
    done | sort -n | sed -n 2p
}
# a failed child exits the pipeline's first part: set -e -o pipefail stops the script there
import_s=$(time_it python -c "import jax; jax.devices()")
command_s=$(time_it python -m tunix_nb.train sft --model tiny --steps 20 --batch-size 16 \
    --metrics-file "$dir/m.jsonl")
rm -rf "$dir"
printf '{"cpus": %s, "import_jax_seconds": %.2f, "command_20_steps_seconds": %.2f}\n' \
    "$(nproc)" "$import_s" "$command_s"
