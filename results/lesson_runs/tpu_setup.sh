#!/usr/bin/env bash
# Installs the lessons' pins on the TPU v5e test machine (no network: its own package index),
# keeping the machine's own JAX 0.10.2 and libtpu first on PYTHONPATH. qwix, which that index
# lacks, and the pins it holds at other versions (orbax-checkpoint 0.12.8, ...), come as wheels
# carried in .whl-tpu/ (`pip download --no-deps` of each pure-Python pin and qwix==0.1.8).
# Usage: source results/lesson_runs/tpu_setup.sh   (then PYTHONPATH ends with $SITE and the repository)
set -e
SITE="${TMPDIR:-/tmp}/tunix_site"
# scipy: the machine's own (it comes with its JAX)
grep -v -E '^(jax|jaxlib|scipy)==' requirements-lessons.txt | grep -E '^[A-Za-z]' > "$SITE.pins"
echo "ipython" >> "$SITE.pins"
echo "pytest-timeout" >> "$SITE.pins"
pip_here() {
    local log rc
    log=$(PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
        --index-url file:///opt/pypi/simple --find-links .whl-tpu --target "$SITE" "$@" 2>&1)
    rc=$?
    printf '%s\n' "$log" | grep -v -i warning
    return $rc
}
# all at once; where that fails, pin by pin, so that one pin neither carried nor in the index
# is named and the others still install
if [ ! -d "$SITE/flax" ] && ! pip_here -r "$SITE.pins"; then
    while read -r pin; do pip_here "$pin" || echo "tpu_setup: could not install $pin"; done < "$SITE.pins"
fi
# what the unit tests import beyond the lessons (requirements.txt brings them with Jupyter), apart,
# so that the lessons' install does not hang on them
[ -d "$SITE/nbformat" ] || pip_here nbformat httpx || echo "tpu_setup: could not install nbformat httpx"
# pip brings its own jax, jaxlib and numpy along: the machine's own stay
rm -rf "$SITE"/jax "$SITE"/jax-* "$SITE"/jaxlib "$SITE"/jaxlib-* "$SITE"/numpy "$SITE"/numpy-* "$SITE"/numpy.libs "$SITE"/libtpu* "$SITE"/bin
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE:$PWD"
set +e
