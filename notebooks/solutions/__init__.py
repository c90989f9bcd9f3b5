"""Solutions to the lessons' exercises, as functions a test can check.

Every notebook ends with two to four exercises and a collapsed `<details>` block of
written solutions. This folder, beside the lessons and outside the installable package,
holds one module per lesson, `lesson00` ... `lesson08`, and in each one function per
exercise, named for what it computes (for example
`lesson03.equal_token_counts_drift`). A function's docstring starts with
"Lesson NN, exercise K:", states the shapes involved, and the function returns the
numbers the written solution's claim rests on (it prints nothing), computed with the
kit's own APIs. `tests/test_solutions.py` checks every claim, and each notebook's
Solutions block names the function that backs each answer.

Sizes and step counts are arguments with small defaults, so the tests run in seconds
on a CPU; pass the notebook's sizes to reproduce its setting. Like the notebooks, the
modules import JAX (import them as `from solutions import lesson03` from notebooks/):
call `tunix_nb.devices.simulate_cpu_devices` (or a lesson's setup cell) before importing
one if you want simulated devices.
"""
