#!/usr/bin/env bash
# Here (not on the device): the wheels the device machine's Python (3.12, x86-64) lacks for the gpu tests and the
# benches that start the stack, and the decode / extend benches' peer (FlashInfer 0.6.0 with apache-tvm-ffi), into
# .whl/ (ignored by git; carried with `carry: [".whl"]`), pinned to the versions requirements.txt and make install
# use. NIXL is the CUDA 13 build (the device's torch is cu130), slimmed to its runtime (its nixl_ep extensions,
# headers and UCX perftest dropped: 59 -> 29 MiB). bench/gpu_run.sh installs them.
# Usage (repo root): bash bench/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
platforms=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms="$platforms --platform ${p}_x86_64"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl \
  nixl-cu13==1.5.1 fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 orjson==3.13.0 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 opentelemetry-api==1.45.3 importlib_metadata==10.2.0 \
  openai==3.51.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 \
  flashinfer-python==0.6.0 apache-tvm-ffi==0.1.15.post2 \
  2>&1 | grep -v "^WARNING: Location" || true
nixl=$(ls .whl/nixl_cu13-1.5.1-*.whl)
listing=$(unzip -l "$nixl")
if [[ "$listing" == *nixl_ep_cu13/* ]]; then
  zip -q -d "$nixl" 'nixl_ep_cu13/*' '*perftest*' '*/include/*' >/dev/null
fi
ls .whl | wc -l | xargs echo "wheels in .whl:"
du -sh .whl
