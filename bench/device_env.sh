# Device machine, sourced from the repository root (by gpu_run.sh, or before an ad-hoc command:
# `source bench/device_env.sh; python3 bench/agents.py --gpu ...`): the repository importable as `kvserving`
# without installing it (a package folder of links under $KVPKG), the wheels carried in .whl/ installed with
# --target onto PYTHONPATH, $OUT made.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PKG=${KVPKG:-/tmp/kvpkg}; rm -rf "$PKG"; mkdir -p "$PKG/kvserving"
cp -r common/. "$PKG/kvserving/"
for sub in kernels worker gateway operator agents calibrate sim local crds; do ln -s "$PWD/$sub" "$PKG/kvserving/$sub"; done
export PYTHONPATH=$PKG
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PKG:/tmp/site
fi
export PYTHONUNBUFFERED=1
