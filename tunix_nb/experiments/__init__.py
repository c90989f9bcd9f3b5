"""Experiments over seeds: the claims the lessons make about methods, as statistics.

`stats` holds the statistics (paired gains with a 95% interval over seeds and test
prompts, pass@k, edit similarity); `runner` runs an experiment's arms over seeds and
stores the record; each experiment is a module of its own, named for what it asks:

- `scarce_labels` (lesson 02): distillation when labels are scarce and prompts are free;
- `long_family` (lessons 08 and 11): the long task family's splits, checkpoints and pilot gate;
- `count_family` and `count14_family` (lesson 11): running counts, of 6-14 bits and of exactly 14;
- `grpo_pass_at_k` (lesson 08): GRPO turning pass@k into pass@1 on long answers;
- `gkd_long_answers` (lesson 11): on-policy distillation where errors compound.

`python -m tunix_nb.experiments <experiment> --seeds 5 --out results/<file>.json` makes a
stored run; the lessons read it and rerun fewer seeds live.
"""

EXPERIMENTS = {"lesson02_distillation": "scarce_labels", "lesson08_grpo": "grpo_pass_at_k",
               "lesson11_gkd": "gkd_long_answers"}
