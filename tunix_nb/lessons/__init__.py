"""The lessons run headless: `python -m tunix_nb.lessons run [NN ...] --out FILE`.

For machines where no Jupyter kernel can start (some sandboxes forbid the TCP sockets
ipykernel needs). Each lesson runs in a fresh Python process, since JAX fixes its devices
when it starts; there an in-process IPython shell runs the code cells in order, so `!cmd`,
`%magic` and `%%writefile` work as in Jupyter. One JSON record per run holds, per lesson,
the backend, each cell's time and the first failing cell; `python -m tunix_nb.lessons table`
renders the README's "Runs on" table from the records in results/lesson_runs/.

- `shell`: the child: one notebook's code cells in an `InteractiveShell`
- `hashes`: what a record was made from (code cells, `tunix_nb`), now or at a commit
- `runner`: a child per lesson, with a timeout; the run's record
- `records`: the records' schema, and the README table rendered from them

Importing this package imports neither JAX nor IPython.
"""
