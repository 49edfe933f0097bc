#!/usr/bin/env bash
# verl 0.9.1 and what it imports, as one pruned archive that travels with a device call. Runs on any x86-64 Linux
# box with pip and PyPI. Three stacks:
#
#   STACK=own DEST=.peers bash tools/peers/build_site.sh   # -> .peers/verl_stack.tar.xz: verl on its own pinned
#       stack, self-contained over the GPU image's torch 2.11.0: SGLang 0.5.12 (verl[sglang]'s pin) with its
#       sglang-kernel, flashinfer, xgrammar and tvm-ffi pins, transformers 5.9.0 (verl[sglang]'s pin; SGLang 0.5.12
#       itself pins 5.6.0, which verl's core requirement `!=5.6.0,<5.11` excludes), tokenizers 0.22.2 (the image's
#       0.23.2 is past transformers 5.9.0's `<=0.23.0`), the HTTP stack, Ray. SGLang 0.5.12's other requirements
#       (flash-attn-4, outlines, llguidance, torchao, tilelang, deep-gemm, cutlass-dsl, ...) serve backends and
#       features the runs do not use and are imported lazily, as for the dsrl site. 54.5 MiB (370 MB unpacked): not
#       beside the dsrl site (.gpu, ~53 MiB with its JIT cache) in one call (64 MiB a call in all), so it travels in
#       a call of its own that unpacks it into /tmp/verlstack on the held machine; the runs come in later calls
#       (tools/peers/peers.py's docstring, docs/benchmarks/verl.md).
#   DEST=.peers bash tools/peers/build_site.sh               # -> .peers/verl_site.tar.xz (~19 MiB): verl and what
#       the dsrl site (../shared/gpu/build_site.sh: SGLang 0.5.17, transformers 5.12.1, the HTTP stack) lacks, layered
#       over that site: how verl ran before issue 53, on dsrl's stack.
#   RAY_ONLY=1 DEST=.gpu bash tools/peers/build_site.sh      # -> .gpu/ray_site.tar.xz: Ray alone, pruned the same
#       way, for dsrl's Ray fleet on GPUs (tools/gpu_run.sh's setup unpacks it)
#
# On the GPU machine: mkdir -p /tmp/verlstack && tar xJf .peers/verl_stack.tar.xz -C /tmp/verlstack (gpu_run.sh's
# `peers_unpack` stage); tools/peers/peers.py puts the site on verl's PYTHONPATH for its verl runs only, and for a
# self-contained stack (one holding sglang/) leaves the dsrl site off it.
# Ray: its core (raylet, GCS, _raylet.so) and Python package; the dashboard's web client, the Java jars and the
# libraries verl does not import (RLlib, Tune, Train, Serve, Data, LLM) are pruned, the binaries stripped. Ray
# then runs as its minimal install does (no dashboard): verl's runs pass ray_init.include_dashboard=false.
# SGLang's kernels: sm90 only (H100/H200), FA3's flash_ops and FlashMLA dropped (the runs use triton attention), as
# ../shared/gpu/build_site.sh prunes the dsrl site.
set -euo pipefail
STACK=${STACK:-layer}
[ "${RAY_ONLY:-0}" = 1 ] && STACK=ray
case $STACK in own) NAME=verl_stack ;; ray) NAME=ray_site ;; layer) NAME=verl_site ;;
  *) echo "STACK=$STACK: one of own, layer, ray" >&2; exit 2 ;; esac
OUTDIR=${OUTDIR:-/tmp/$NAME}
DEST=${DEST:-}
PY=${PY:-python3}
W=$OUTDIR/wheels; SITE=$OUTDIR/site
mkdir -p "$W"; rm -rf "$SITE"; mkdir -p "$SITE"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
# verl's requirements (its METADATA) less what the image has (accelerate, pandas, pyarrow, pybind11, peft, numpy,
# packaging, tensorboard) or the dsrl site has; wandb is imported only for its logger, which the harness leaves off.
PKGS=(
  verl==0.9.1 ray==2.60.0 hydra-core==1.3.2 omegaconf==2.3.0 codetiming==1.4.0 torchdata==0.11.0
  tensordict==0.10.0 pyvers==0.1.0 importlib-metadata==10.2.0 datasets==5.2.0 multiprocess==0.70.19
  transferqueue==0.1.11 pylatexenc==2.11 cachetools==8.0.2
)
# verl's own stack: SGLang 0.5.12's pins, and what its server imports that the image lacks (the dsrl site's list for
# SGLang 0.5.17, ../shared/gpu/build_site.sh, at 0.5.12's pins where it has them)
OWN=(
  sglang==0.5.12 sglang-kernel==0.4.2.post2 flashinfer-python==0.6.11.post1 torch-memory-saver==0.0.10
  transformers==5.9.0 tokenizers==0.22.2 xgrammar==0.2.0 apache-tvm-ffi==0.1.9 openai==2.6.1 soundfile==0.13.1
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2
  orjson==3.13.0 pybase64==1.5.1 pyzmq==27.3.0 msgspec==0.22.0 setproctitle==1.3.8 dill==0.4.1
  ipython==9.18.1 traitlets==5.16.1 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7
  compressed-tensors==0.20.0 loguru==0.7.3 gguf==0.19.0 cffi==2.1.1 pycparser==3.12
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
case $STACK in ray) PKGS=(ray==2.60.0) ;; own) PKGS+=("${OWN[@]}") ;; esac
$PY -m pip download -q --no-deps $PLAT -d "$W" "${PKGS[@]}"
# hydra's parser runtime ships as source only: a pure-python wheel
[ "$STACK" = ray ] || ls "$W"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 || $PY -m pip wheel -q --no-deps -w "$W" antlr4-python3-runtime==4.9.3
$PY -m pip install -q --no-deps --no-compile --no-index $PLAT --target "$SITE" "$W"/*.whl

R=$SITE/ray
rm -rf "$R"/jars "$R"/dashboard/client "$R"/rllib "$R"/tune "$R"/train "$R"/serve "$R"/data "$R"/llm "$R"/workflow
strip --strip-unneeded "$R"/_raylet.so "$R"/core/src/ray/gcs/gcs_server "$R"/core/src/ray/raylet/raylet
if [ "$STACK" = own ]; then
  rm -rf "$SITE"/sgl_kernel/flash_ops*.so "$SITE"/sgl_kernel/sm100 "$SITE"/sgl_kernel/flashmla_ops*.so "$SITE"/lib/*.a
  rm -rf "$SITE"/sglang/multimodal_gen "$SITE"/sglang/srt/server/_core*.so "$SITE"/sglang/srt/grpc/_core*.so \
    "$SITE"/sglang/srt/multimodal/_core*.so
  rm -rf "$SITE"/flashinfer/data/cutlass/{examples,python,test,media,docs} \
    "$SITE"/flashinfer/data/cccl/{python,benchmarks,docs,ci,examples,test}
  rm -f "$SITE"/torch_memory_saver_hook_mode_*_cu12.abi3.so "$SITE"/torch_memory_saver_hook_mode_preload.abi3.so \
    "$SITE"/torch_memory_saver_hook_mode_torch.abi3.so
  rm -rf "$SITE"/xgrammar/lib/libxgrammar.a
  strip --strip-debug "$SITE"/xgrammar/*.so "$SITE"/torch_memory_saver_hook_mode_*_cu13.abi3.so 2>/dev/null || true
fi
rm -rf "$SITE"/bin
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
find "$SITE" -path "*/tests" -prune -exec rm -rf {} +
du -sh "$SITE"
tar -C "$SITE" -cf - . | xz -T0 -9 > "$OUTDIR/$NAME.tar.xz"
ls -la "$OUTDIR/$NAME.tar.xz"
if [ -n "$DEST" ]; then mkdir -p "$DEST" && cp "$OUTDIR/$NAME.tar.xz" "$DEST/"; fi
