#!/usr/bin/env bash
# The training command on a TPU v5e chip at Qwen3-0.6B's shapes (issue 47, item 5): random weights
# written on the chip (python -m tunix_nb.random_checkpoint), then full fine-tuning (AdamW, float32
# weights) and LoRA r16 (bfloat16 base), batch 8 x 1024 tokens, bfloat16 compute, remat, 15 steps
# each, measured by python -m tunix_nb.measure_command: the step's compiles and their seconds, step
# times, MFU by model FLOPs (tunix_nb.mfu) and XLA's FLOPs over the chip's peak.
# Writes $OUT/tpu_v5e_training.json (both runs, the commit, this script's settings) and each run's
# log tail in $OUT/<run>.log. The machine has no .git: the commit comes as an argument.
#
# Usage, on the chip:  bash results/tpu_v5e_training/run.sh COMMIT
#   RUNS picks the runs (default "full lora_r16"); full_scan and lora_r16_scan add --scan-layers
#   (the blocks as one scan: the compile against depth); "llama_qlora_r16" is Llama-3.2-1B with QLoRA
#   (nf4 base, rank 16), its own call:  RUNS=llama_qlora_r16 bash results/tpu_v5e_training/run.sh COMMIT
#   BATCH, LENGTH and STEPS change the shapes (default 8, 1024, 15), e.g. to find the largest batch that fits
#   SEQ_CHUNK=256 takes the loss's positions 256 at a time (--seq-chunk; default: all at once)
#   VOCAB_CHUNK=none computes the loss over the full logits (--vocab-chunk; default auto: chunks of 8192)
#   REMAT_POLICY=save_attention keeps splash attention's output through remat (--remat-policy), for every run;
#   save_projections also the projections' outputs
#   TRACE_STEPS=3 profiles 3 steps after the warm-up (measure_command --trace-steps: where the step's time goes);
#   TRACE_TOP=40 names the 40 slowest ops and sources in it (--trace-top; default 10)
#   "fit_or_oom": the largest batch that fits, by running the command from the plan's answer outwards
#   (fit_or_oom.py; the plan: largest_batch_plan.json); its record is $OUT/fit_or_oom.json
#   "tunix_lora_r16": Tunix 0.1.7's own Qwen3 and PeftTrainer beside the kit's LoRA r16 command, in one process
#   (tunix_side_by_side.py; its wheels carried in .whl-tunix/, installed without their dependencies)
# On a CPU, to check it end to end (tiny preset for every run, 2 x 64 tokens, 4 steps, no installs):
#                      OUT=$(mktemp -d) bash results/tpu_v5e_training/run.sh COMMIT --cpu-check
commit="${1:?give the commit the working tree is at}"
runs="${RUNS:-full lora_r16}"
if [ "${2:-}" = "--cpu-check" ]; then
    qwen=tiny; llama=tiny; batch=2; length=64; steps=4; run_limit=120
else
    source results/lesson_runs/tpu_setup.sh
    qwen=qwen3-0.6b; llama=llama-3.2-1b; run_limit=270  # two runs a 10-minute call
    batch="${BATCH:-8}"; length="${LENGTH:-1024}"; steps="${STEPS:-15}"  # BATCH=16 RUNS=full: a bigger batch
fi
: "${OUT:?set OUT to the folder the record goes to}"
mkdir -p "$OUT"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export TUNIX_NB_COMPILE_CACHE="$work/jax_cache"  # a cold cache: the compile is measured, not read back
folder_of() { case "$1" in full|lora_r16|full_scan|lora_r16_scan|tunix_lora_r16|fit_or_oom) echo qwen ;; llama_qlora_r16) echo llama ;; *) return 1 ;; esac; }
for run in $runs; do  # each model's folder once, with random weights
    name="$(folder_of "$run")" || { echo "unknown run $run: choose from full lora_r16 full_scan lora_r16_scan llama_qlora_r16 tunix_lora_r16 fit_or_oom" >&2; exit 2; }
    preset="$qwen"; [ "$name" = llama ] && preset="$llama"
    [ -d "$work/$name" ] || python -m tunix_nb.random_checkpoint --preset "$preset" --out "$work/$name" || exit 1
done
# rows of text longer than the rows the step takes (the byte tokenizer: one token a byte)
python -c "
import json, random, sys
words = 'the a of to in is on at by for with from model step chip token batch layer'.split()
rng = random.Random(0)
with open(sys.argv[1], 'w') as f:
    for _ in range(256):  # more rows than the largest batch fit_or_oom tries
        f.write(json.dumps({'text': ' '.join(rng.choice(words) for _ in range(int(sys.argv[2]) // 2))}) + '\n')
" "$work/rows.jsonl" "$length"
trace=(); [ -n "${TRACE_STEPS:-}" ] && trace=(--trace-steps "$TRACE_STEPS" --trace-top "${TRACE_TOP:-10}")
# the loss's positions all at once by default (faster on the chip: README "Remedies"); SEQ_CHUNK=256 as before b83fc32
seq_chunk=(); [ -n "${SEQ_CHUNK:-}" ] && [ "$SEQ_CHUNK" != none ] && seq_chunk=(--seq-chunk "$SEQ_CHUNK")
# REMAT_POLICY: what remat keeps (--remat-policy: full, the default, save_attention or save_projections)
remat_policy=(); [ -n "${REMAT_POLICY:-}" ] && remat_policy=(--remat-policy "$REMAT_POLICY")
common=(sft --train-file "$work/rows.jsonl" --max-length "$((length + 1))"
        --batch-size "$batch" --steps "$steps" --remat "${remat_policy[@]}" --compute-dtype bfloat16
        --vocab-chunk "${VOCAB_CHUNK:-auto}"
        "${seq_chunk[@]}" --learning-rate 1e-4)
# no machine path in a log: the work folder as $WORK, the checkout's relative, and JAX's warning
# about hugepages (it names where the machine's JAX lives) dropped with its next line
clean=(-e "s|$work|\$WORK|g" -e "s|$PWD/||g" -e '/cloud_tpu_init.py:[0-9]*: UserWarning/{N;d}')
if [[ " $runs " == *" tunix_lora_r16 "* && "${2:-}" != "--cpu-check" ]]; then
    pip_here --no-deps .whl-tunix/*.whl || echo "run.sh: could not install Tunix's wheels from .whl-tunix/"
fi
for run in $runs; do
    if [ "$run" = tunix_lora_r16 ]; then  # not measure_command's record: the side-by-side's own
        timeout "$((run_limit * 2 + 20))" python results/tpu_v5e_training/tunix_side_by_side.py --model "$work/qwen" \
            --rows "$work/rows.jsonl" --out "$work/$run.json" --batch "$batch" --length "$length" --steps "$steps" \
            --kit-flags="${remat_policy[*]}${VOCAB_CHUNK:+ --vocab-chunk $VOCAB_CHUNK}" \
            > "$work/$run.out" 2>&1
        echo "== $run: exit $?" > "$OUT/$run.log"
        tail -c 4000 "$work/$run.out" | sed "${clean[@]}" >> "$OUT/$run.log"
        continue
    fi
    if [ "$run" = fit_or_oom ]; then  # the largest batch by running, from the plan's (largest_batch_plan.json)
        grid=(); [ "${2:-}" = "--cpu-check" ] && grid=(--grid 2,4)
        # within a 10-minute call after the setup and the weights (7f5c452's first try ran past it and
        # returned nothing); the record is written after every run, the log as it goes
        PYTHONUNBUFFERED=1 timeout 420 python results/tpu_v5e_training/fit_or_oom.py --model "$work/qwen" \
            --rows "$work/rows.jsonl" --plan results/tpu_v5e_training/largest_batch_plan.json --length "$length" \
            --out "$OUT/fit_or_oom.json" "${grid[@]}" 2>&1 | sed "${clean[@]}" > "$OUT/$run.log"
        continue
    fi
    case "$run" in
        full) extra=(--model "$work/qwen") ;;
        lora_r16) extra=(--model "$work/qwen" --lora-rank 16) ;;
        full_scan) extra=(--model "$work/qwen" --scan-layers) ;;
        lora_r16_scan) extra=(--model "$work/qwen" --lora-rank 16 --scan-layers) ;;
        # its blocks as one scan, as the Qwen runs since 4068b73: largest_batch_plan.json's "qlora" row plans this step
        llama_qlora_r16) extra=(--model "$work/llama" --lora-rank 16 --quantize nf4 --scan-layers) ;;
    esac
    timeout "$run_limit" python -m tunix_nb.measure_command --out "$work/$run.json" "${trace[@]}" -- "${common[@]}" "${extra[@]}" \
        > "$work/$run.out" 2>&1
    echo "== $run: exit $?" > "$OUT/$run.log"
    tail -c 4000 "$work/$run.out" | sed "${clean[@]}" >> "$OUT/$run.log"
done
python -c "
import json, sys
from pathlib import Path
work, out, commit = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
runs = {run: json.loads((work / f'{run}.json').read_text()) if (work / f'{run}.json').is_file() else None
        for run in sys.argv[4].split()}
record = {'commit': commit, 'script': 'results/tpu_v5e_training/run.sh', 'runs': runs}
# the machine's temporary folder, as \$WORK: no machine path in a stored record
(out / 'tpu_v5e_training.json').write_text(json.dumps(record, indent=2).replace(str(work), '\$WORK') + '\n')
for run, r in runs.items():
    print(run, None if r is None else {k: r.get(k) for k in ('step_compiles', 'step_compile_seconds',
          'median_step_seconds', 'tokens_per_second', 'mfu', 'xla_flops_utilisation')})
    profile = (r or {}).get('profile') or {}
    if profile:
        print('  by kind:', [(k['name'], round(k['share'], 3)) for k in profile['ops'].get('by_kind', [])])
        print('  by source:', [(k['name'], round(k['share'], 3)) for k in profile['ops'].get('by_source', [])[:6]])
        print('  programs:', profile.get('programs') and {k: profile['programs'][k] for k in ('runs', 'busy_share')})
" "$work" "$OUT" "$commit" "$runs"
