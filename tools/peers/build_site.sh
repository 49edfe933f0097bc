#!/usr/bin/env bash
# verl 0.9.1 and what it imports that the GPU image and the dsrl site (../shared/gpu/build_site.sh: SGLang 0.5.17,
# transformers 5.12.1, the HTTP stack, pyzmq, msgspec, orjson, dill) lack, as one pruned archive that travels with
# a device call beside .gpu/site.tar.xz (64 MiB a call in all). Runs on any x86-64 Linux box with pip and PyPI.
#
#   DEST=.peers bash tools/peers/build_site.sh      # -> .peers/verl_site.tar.xz (~23 MiB)
#   RAY_ONLY=1 DEST=.gpu bash tools/peers/build_site.sh   # -> .gpu/ray_site.tar.xz: Ray alone, pruned the same way,
#                                                  # for dsrl's Ray fleet on GPUs (tools/gpu_run.sh's setup unpacks it)
#
# On the GPU machine: mkdir -p /tmp/verlsite && tar xJf .peers/verl_site.tar.xz -C /tmp/verlsite, and put
# /tmp/verlsite on verl's PYTHONPATH (tools/peers/peers.py does, for its verl runs only).
# Ray: its core (raylet, GCS, _raylet.so) and Python package; the dashboard's web client, the Java jars and the
# libraries verl does not import (RLlib, Tune, Train, Serve, Data, LLM) are pruned, the binaries stripped. Ray
# then runs as its minimal install does (no dashboard): verl's runs pass ray_init.include_dashboard=false.
set -euo pipefail
NAME=$([ "${RAY_ONLY:-0}" = 1 ] && echo ray_site || echo verl_site)
OUTDIR=${OUTDIR:-/tmp/$NAME}
DEST=${DEST:-}
PY=${PY:-python3}
W=$OUTDIR/wheels; SITE=$OUTDIR/site
mkdir -p "$W"; rm -rf "$SITE"; mkdir -p "$SITE"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
# verl's requirements (its METADATA) less what the image has (accelerate, pandas, pyarrow, pybind11, peft, numpy,
# packaging, tensorboard) or the dsrl site has; wandb is imported only for its logger, which the harness leaves off.
PKGS=(
  verl==0.9.1 ray==2.60.0 hydra-core==1.3.2 omegaconf==2.3.0 codetiming==1.4.0 torchdata==0.11.0
  tensordict==0.10.0 pyvers==0.1.0 importlib-metadata==10.2.0 datasets==5.2.0 multiprocess==0.70.19
  transferqueue==0.1.11 pylatexenc==2.11 cachetools==8.0.2
)
if [ "${RAY_ONLY:-0}" = 1 ]; then PKGS=(ray==2.60.0); fi
$PY -m pip download -q --no-deps $PLAT -d "$W" "${PKGS[@]}"
# hydra's parser runtime ships as source only: a pure-python wheel
[ "$NAME" = ray_site ] || ls "$W"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 || $PY -m pip wheel -q --no-deps -w "$W" antlr4-python3-runtime==4.9.3
$PY -m pip install -q --no-deps --no-compile --no-index $PLAT --target "$SITE" "$W"/*.whl

R=$SITE/ray
rm -rf "$R"/jars "$R"/dashboard/client "$R"/rllib "$R"/tune "$R"/train "$R"/serve "$R"/data "$R"/llm "$R"/workflow
strip --strip-unneeded "$R"/_raylet.so "$R"/core/src/ray/gcs/gcs_server "$R"/core/src/ray/raylet/raylet
rm -rf "$SITE"/bin
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
find "$SITE" -path "*/tests" -prune -exec rm -rf {} +
du -sh "$SITE"
tar -C "$SITE" -cf - . | xz -T0 -9 > "$OUTDIR/$NAME.tar.xz"
ls -la "$OUTDIR/$NAME.tar.xz"
if [ -n "$DEST" ]; then mkdir -p "$DEST" && cp "$OUTDIR/$NAME.tar.xz" "$DEST/"; fi
