#!/usr/bin/env bash
# What the GPU machine runs, stage by stage; each stage logs to $OUT/<stage>.log and the summary
# of every stage is printed last. Usage (on the GPU machine, from the repo root):
#   source .gpu/setup.sh; bash tools/gpu_run.sh setup colocate toy greedy rollout   # 1 GPU
#   source .gpu/setup.sh; bash tools/gpu_run.sh setup bench_ipc                      # 1 GPU
#   source .gpu/setup.sh; bash tools/gpu_run.sh crash                                # 1 GPU
#   source .gpu/setup.sh; MODELS=0.5b bash tools/gpu_run.sh setup kill9               # 1 GPU (kill -9 of dsrl train)
#   source .gpu/setup.sh; bash tools/gpu_run.sh setup disaggregate bench_nccl        # 2 GPUs
#   source .gpu/setup.sh; bash tools/gpu_run.sh setup ray_colocate                   # 1 GPU, Ray importable
#   source .gpu/setup.sh; bash tools/gpu_run.sh readme custom_rollout                # 1 GPU (docs/gpus.md)
#   source .gpu/setup.sh; MODELS=3b bash tools/gpu_run.sh setup step                  # 1 GPU (64x8x512 step)
#   source .gpu/setup.sh; MODELS=1.5b bash tools/gpu_run.sh setup ppo                 # 1 GPU (PPO, critic)
#   source .gpu/setup.sh; bash tools/gpu_run.sh setup ray_fleet routes               # 2 GPUs, Ray importable
#   source .gpu/setup.sh; MODELS="0.5b-chat" bash tools/gpu_run.sh setup agent_toy agent_calc bench_agent  # 1 GPU
#   source .gpu/setup.sh; MODELS="0.5b-chat 1.5b-chat" MODELS_LIMIT=100 bash tools/gpu_run.sh setup bench_agent agent_calc8
#                         # 1 GPU, one call of < 560 s: multi-turn rollout cost and the 8-turn calculator agent (issue 38)
#   source .gpu/setup.sh; MODELS=3b bash tools/gpu_run.sh setup bench_trainer       # 1 GPU (tools/bench_trainer.py)
#   source .gpu/setup.sh; MODELS="1.5b 3b" bash tools/gpu_run.sh setup lora          # 1 GPU (LoRA: adapter/merged/full)
#   source .gpu/setup.sh; MODELS=1.5b bash tools/gpu_run.sh setup throughput         # 1 GPU (SGLang's own rollout
#                         throughput vs dsrl's client, per attention backend: TP_BACKENDS; ~300 s a backend cold)
#   source .gpu/setup.sh; MODELS=1.5b bash tools/gpu_run.sh setup peers              # 1 GPU (verl beside dsrl:
#                                                         tools/peers/; .peers/verl_site.tar.xz carried, see build_site.sh)
#     (LoRA against full fine-tuning at 3B and 7B, LoRA PPO before/after: the calls in docs/benchmarks/lora.md, "LoRA against full")
#   Longer than one call (verl's toy run to 100 steps, two seeds: ~1,400 s): tools/gpu_detach.sh runs the stages
#   detached on the held machine and brings back their output call by call (docs/benchmarks/verl.md).
#   source .gpu/setup.sh; MODELS="1.5b 1.5b-rm" bash tools/gpu_run.sh setup rm       # 1 GPU (reward model, 3 tenants)
#   source .gpu/setup.sh; bash tools/gpu_run.sh setup split_hang placements           # 4 GPUs: every placement, one
#                         line each (issue 52; PLACEMENTS="dis2x2 off2x2|colo4" picks them, in waves; ray2x2 needs
#                         .gpu/ray_site.tar.xz). 8 GPUs (issue 54): PLACEMENTS="colo8|colo8_tp2|dis4x4|async4x4_partial"
#   source .gpu/setup.sh; MODELS=1.5b SOAK_RUNS="colo1:1 colo1_kill:1:kill5" bash tools/gpu_run.sh setup update_memory soak
#                         # 1 GPU: nothing dies under the tail workload, a kill -9 costs one step (issue 60; tools/soak.py)
#   source .gpu/setup.sh; MODELS=1.5b bash tools/gpu_run.sh setup fp8 fp8_toy     # 1 GPU (issue 64: FP8 rollout
#                         against bf16 on the tail workload, and on the GPU toy; FP8_MODEL=7b with FP8_RUNS: see the stage)
#   source .gpu/setup.sh; MODELS=1.5b bash tools/gpu_run.sh setup gate               # 1 GPU (issue 89: the 1.5B `tail`
#                         step, phases, update peak, sync GB/s and mismatch against tools/baselines/gate_tail_1.5b.json)
#   source .gpu/setup.sh; MODELS="3b vl-3b vl-data" bash tools/gpu_run.sh setup vl   # 1 GPU (issue 88: a Qwen2.5-VL-3B
#                         shape on geo3k-like rows, then its text-only twin; docs/benchmarks.md "Vision-language")
#   source .gpu/setup.sh; bash tools/gpu_run.sh async                                # 2 GPUs (tools/bench_async.py;
#                                                         ASYNC_EXTRA="--rollout.max_concurrency 768" passes flags on)
# Wheels the image lacks travel in .whl/ (carried; `setup` installs them into /tmp/site): peft, sgl-deep-gemm (the
# `fp8` stage's DeepGEMM), and liger-kernel for --model.liger_kernel / bench_trainer --liger (`pip download --no-deps liger-kernel -d .whl`).
# Pinning stages to GPUs with CUDA_VISIBLE_DEVICES holds for `dsrl train` stages (toy, colocate,
# disaggregate, async); bench_ipc and bench_nccl (tools/bench_sync.py) always use GPU 0 (and 1).
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/models
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/jitcache/torch_extensions  # DeepSpeed's FusedAdam build, kept in jitcache
# DeepSpeed 0.19.8's op builder cannot parse arch suffixes ("9.0a" -> ValueError) when compiling FusedAdam
export TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

stage() {  # stage NAME TIMEOUT_S COMMAND...; with BUDGET=S (the call's seconds) no stage runs past S - 30,
  local name=$1 limit=$2; shift 2  # so the logs' archive and the summary still come back
  local start=$SECONDS
  if [ -n "${BUDGET:-}" ]; then
    local left=$((BUDGET - 30 - SECONDS))
    [ "$left" -lt 10 ] && { note "== $name: skipped, the call's BUDGET is spent"; return 124; }
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  note "== $name: rc=$rc in $((SECONDS - start))s"
  return $rc
}

# One placement of the `placements` stage: `dsrl train` (or the launcher) on a small run, then one summary line
# (PASS: it ran every step with each sync's probe matching the trainer's weights, and exited 0). $2: the GPUs it sees,
# in order (CUDA_VISIBLE_DEVICES; empty: all, as they are).
placement() {
  local name=$1 args cmd=(python3 -m dsrl.cli train) pre=()
  [ -n "${2:-}" ] && pre=(env "CUDA_VISIBLE_DEVICES=$2")
  local dis=(--config configs/gpu_disaggregate.yaml --trainer.num_ranks 2 --rollout.num_servers 2 --rollout.first_gpu 2)
  local colo=(--config configs/gpu_colocate.yaml --trainer.num_ranks 4 --rollout.num_servers 4)
  local dis4=(--config configs/gpu_disaggregate.yaml --trainer.num_ranks 4 --rollout.num_servers 4 --rollout.first_gpu 4)
  case $name in
    dis2x2) args=("${dis[@]}") ;;
    dis2_tp2) args=("${dis[@]}" --rollout.num_servers 1 --rollout.tp_size 2) ;;
    off2x2) args=("${dis[@]}" --rollout.max_staleness 1 --algorithm.off_policy tis) ;;
    async2x2_partial) args=("${dis[@]}" --rollout.max_staleness 2 --rollout.interrupt partial --algorithm.off_policy tis) ;;
    async2x2_pause) args=("${dis[@]}" --rollout.max_staleness 4 --rollout.interrupt pause --rollout.max_ahead 1
                          --algorithm.off_policy tis) ;;
    colo2) args=(--config configs/gpu_colocate.yaml --trainer.num_ranks 2 --rollout.num_servers 2) ;;
    colo4) args=("${colo[@]}") ;;
    colo4_tp2) args=("${colo[@]}" --rollout.num_servers 2 --rollout.tp_size 2) ;;
    # 8 GPUs (issue 54): every GPU of the host, so no rotation
    colo8) args=(--config configs/gpu_colocate.yaml --trainer.num_ranks 8 --rollout.num_servers 8) ;;
    colo8_tp2) args=(--config configs/gpu_colocate.yaml --trainer.num_ranks 8 --rollout.num_servers 4 --rollout.tp_size 2) ;;
    dis4x4) args=("${dis4[@]}") ;;
    async4x4_partial) args=("${dis4[@]}" --rollout.max_staleness 2 --rollout.interrupt partial --algorithm.off_policy tis) ;;
    ray2x2)  # a Ray cluster that owns GPUs 2-3 places the servers; the trainer ranks take GPUs 0-1
      CUDA_VISIBLE_DEVICES=2,3 timeout 120 python3 -m ray.scripts.scripts start --head --num-gpus 2 --num-cpus 16 \
        --include-dashboard false --disable-usage-stats > "$OUT/ray_start.log" 2>&1 || note "ray start failed"
      pre=(env CUDA_VISIBLE_DEVICES=0,1); args=("${dis[@]}" --rollout.fleet ray) ;;  # (ray stop: after the wave)
    launcher)  # the design's launcher, as a user types it: deepspeed --num_gpus 2 --module dsrl.train
      cmd=(python3 -m deepspeed.launcher.runner --num_gpus 2 --master_port 29611 --module dsrl.train)
      args=("${dis[@]}") ;;
    *) note "placement $name: unknown"; return ;;
  esac
  rm -rf "/tmp/runs/pl_$name"
  stage "pl_$name" "${PL_LIMIT:-150}" "${pre[@]}" "${cmd[@]}" "${args[@]}" --model.path "/tmp/models/${PL_MODEL:-0.5b}" \
    --trainer.total_steps "${PL_STEPS:-4}" --logging.tensorboard "$TB" --logging.export_hf false \
    --logging.run_dir "/tmp/runs/pl_$name" --rollout.server_args "$PL_SERVER_ARGS" --sync.timeout_s "${PL_SYNC_TIMEOUT:-60}" \
    --rollout.mem_fraction_static "${PL_MEM:-0.1}" ${PL_EXTRA:-}  # (last: PL_EXTRA's flags override the ones above)
  local rc=$? verdict=FAIL
  grep -aq "final metrics" "$OUT/pl_$name.log" && [ $rc = 0 ] && verdict=PASS
  local figures
  figures=$(python3 tools/step_report.py --line "/tmp/runs/pl_$name" 2>/dev/null || grep -a "Error\|error:" \
    "$OUT/pl_$name.log" | tail -1 | cut -c1-200)
  note "placement $name: $verdict (rc=$rc) | $figures"
  grep -a "written in" "$OUT/pl_$name.log" | sed 's/.*\[dsrl\] /  /' | tee -a "$SUMMARY"  # a checkpoint's, an export's cost
}

# The GPUs this call ran on, whatever its stages (a record without `setup` named none): those CUDA_VISIBLE_DEVICES
# leaves it where it is set (nvidia-smi itself lists every GPU of the host)
[[ " $* " == *" setup "* ]] || nvidia-smi ${CUDA_VISIBLE_DEVICES:+-i "$CUDA_VISIBLE_DEVICES"} --query-gpu=name,uuid \
  --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"
for s in "$@"; do
  case $s in
    setup)
      if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
          > "$OUT/pip.log" 2>&1 || note "wheel install failed (see pip.log)"
      fi
      nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv,noheader | tee -a "$SUMMARY"
      python3 -c "import torch, sglang, deepspeed, transformers, aiohttp, jsonargparse, tqdm; print('torch', torch.__version__, 'sglang', sglang.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1 | tee -a "$SUMMARY"
      python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null || note "no tensorboard here: runs pass --logging.tensorboard false"
      if [ -f .gpu/ray_site.tar.xz ] && [ ! -d /tmp/site/ray ]; then tar xJf .gpu/ray_site.tar.xz -C /tmp/site; fi
      stage models ${MODELS_LIMIT:-300} python3 tools/gpu_models.py /tmp/models ${MODELS:-0.5b 1.5b 3b}
      ;;
    smoke)
      stage smoke 300 python3 tools/gpu_sglang_smoke.py /tmp/models/0.5b
      grep -a "^OK\|^FAIL\|^sleep\|PASSED" "$OUT/smoke.log" | tee -a "$SUMMARY"
      ;;
    crash)  # kill SGLang's scheduler: the fleet must see the server exit and restart it (tools/gpu_server_crash.py)
      stage crash 300 python3 tools/gpu_server_crash.py --workdir /tmp/crash
      grep -a "^RESULT\|^killing\|Error" "$OUT/crash.log" | tee -a "$SUMMARY"
      ;;
    kill9)  # kill -9 of dsrl train mid-step: the run's processes and GPU memory gone within 15 s (tools/bench_kill9.py)
      stage kill9 ${KILL9_LIMIT:-240} python3 tools/bench_kill9.py --config configs/gpu_colocate.yaml --model /tmp/models/${KILL9_MODEL:-0.5b} \
        ${KILL9_RANKS:+--ranks $KILL9_RANKS -- --rollout.num_servers $KILL9_RANKS}
      grep -a "^before\|^RESULT\|Error" "$OUT/kill9.log" | tee -a "$SUMMARY"
      ;;
    smoke_nosaver)
      stage smoke_nosaver 300 python3 tools/gpu_sglang_smoke.py /tmp/models/0.5b --no-memory-saver
      grep -a "^OK\|^FAIL\|PASSED" "$OUT/smoke_nosaver.log" | tee -a "$SUMMARY"
      ;;
    colocate)
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      stage colocate 480 python3 -m dsrl.cli train --config configs/gpu_colocate.yaml --logging.tensorboard $TB \
        --logging.run_dir /tmp/runs/gpu_colocate
      grep -a "\[dsrl\] step\|Error\|final metrics" "$OUT/colocate.log" | tail -5 | sed 's/.*\[dsrl\]//' | tee -a "$SUMMARY"
      ;;
    toy)
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      stage toy ${TOY_LIMIT:-480} python3 -m dsrl.cli train --config configs/toy_gpu.yaml --logging.tensorboard $TB \
        --logging.run_dir /tmp/runs/toy_gpu --trainer.total_steps ${TOY_STEPS:-80}
      grep -a "\[dsrl\] step" "$OUT/toy.log" | sed -n '1p;$p' | sed 's/.*\[dsrl\]//' | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/toy.log" | tee -a "$SUMMARY"
      grep -a "Error" "$OUT/toy.log" | tail -3 | tee -a "$SUMMARY"
      ;;
    greedy)
      stage greedy 300 python3 tools/gpu_greedy_check.py /tmp/runs/toy_gpu/hf --new-tokens 4
      tail -5 "$OUT/greedy.log" | tee -a "$SUMMARY"
      ;;
    rollout)
      stage rollout 420 python3 tools/bench_rollout.py --model /tmp/models/0.5b --engine sglang --requests 256 \
        --server-args '{"attention_backend": "triton", "sampling_backend": "pytorch"}'
      tail -2 "$OUT/rollout.log" | tee -a "$SUMMARY"
      ;;
    throughput)  # 1 GPU: SGLang's own throughput (a bare client) against dsrl's client, each at train's 256 requests in
      # flight, on peers' 1.5B batch (512 x 4 -> 512, logprobs and seeds as train asks) and server flags, per backend
      for be in ${TP_BACKENDS:-triton flashinfer}; do
        stage throughput_$be ${TP_LIMIT:-300} python3 tools/bench_rollout.py --model /tmp/models/${TP_MODEL:-1.5b} \
          --requests 512 --prompt-len 4 --new-tokens 512 --max-concurrency ${TP_CONCURRENCY:-256} --server-args \
          '{"attention_backend": "'$be'", "sampling_backend": "pytorch", "mem_fraction_static": 0.4, "cuda_graph_backend_prefill": "disabled"}'
        grep -a "^rollout throughput\|ready in\|Error" "$OUT/throughput_$be.log" | tail -3 | sed "s/^/$be: /" | tee -a "$SUMMARY"
        log=$(sed -n 's/^server log: //p' "$OUT/throughput_$be.log"); [ -f "$log" ] && tail -c 100000 "$log" > "$OUT/throughput_${be}_server.log"
      done
      ;;
    bench_ipc)
      stage bench_ipc 560 python3 tools/bench_sync.py --mode ipc --models ${IPC_MODELS:-0.5b 1.5b 3b} \
        --bucket-mb ${BUCKETS:-64 256 1024 0} --repeats ${REPEATS:-3} --workdir /tmp/models ${BENCH_EXTRA:-}
      grep -a "^ipc" "$OUT/bench_ipc.log" | tail -26 | tee -a "$SUMMARY"
      ;;
    disaggregate)
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      stage disaggregate 480 python3 -m dsrl.cli train --config configs/gpu_disaggregate.yaml \
        --logging.tensorboard $TB --logging.run_dir /tmp/runs/gpu_disaggregate
      grep -a "\[dsrl\] step\|Error\|final metrics" "$OUT/disaggregate.log" | tail -5 | sed 's/.*\[dsrl\]//' | tee -a "$SUMMARY"
      ;;
    bench_nccl)
      stage bench_nccl 560 python3 tools/bench_sync.py --mode nccl --models ${NCCL_MODELS:-0.5b 1.5b 3b} \
        --bucket-mb ${BUCKETS:-64 256 1024 0} --repeats ${REPEATS:-3} --workdir /tmp/models ${BENCH_EXTRA:-}
      grep -a "^nccl" "$OUT/bench_nccl.log" | tail -26 | tee -a "$SUMMARY"
      ;;
    async)
      stage async ${ASYNC_LIMIT:-590} python3 tools/bench_async.py --gpu --steps ${ASYNC_STEPS:-60} --schedules ${ASYNC_SCHEDULES:-0 7 9} \
        --workdir /tmp/bench_async ${ASYNC_EXTRA:-}
      grep -a "^{\|steps x\|^schedule\|^synchronous\|^one-step\|^async" "$OUT/async.log" | tail -12 | tee -a "$SUMMARY"
      grep -a "Error" "$OUT/async.log" | tail -3 | tee -a "$SUMMARY"
      ;;
    ray_fleet)  # 2 GPUs: a Ray cluster that owns GPU 1 places the SGLang server; the trainer runs on GPU 0
      # Ray must be importable (carry it as wheels: see docs/gpus.md); its workers inherit this shell's env.
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m ray.scripts.scripts start --head --num-gpus 1 --num-cpus 8 \
        --include-dashboard false --disable-usage-stats > "$OUT/ray_start.log" 2>&1 || note "ray start failed (ray_start.log)"
      CUDA_VISIBLE_DEVICES=0 stage ray_fleet 480 python3 -m dsrl.cli train --config configs/gpu_disaggregate.yaml \
        --model.path /tmp/models/${RAY_MODEL:-3b} --rollout.fleet ray --trainer.total_steps ${RAY_STEPS:-8} \
        --logging.tensorboard $TB --logging.run_dir /tmp/runs/ray_fleet
      timeout 60 python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
      grep -a "placed by Ray\|on Ray node\|weight-update group\|\[dsrl\] step\|Error" "$OUT/ray_fleet.log" | sed 's/.*\[dsrl\]//' | tail -12 | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/ray_fleet.log" | grep -o '"sync/[a-z_]*": [0-9.e-]*\|"timing/sync[a-z_]*": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      ;;
    ppo)  # 1 GPU: PPO with a critic colocated with SGLang (actor + ref + critic + server share the GPU); PPO_GATHER="module
      # layer": one run per ZeRO-3 gathering (--trainer.gather_per_layer), the last line the first against the second
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      runs=()
      for gather in ${PPO_GATHER:-layer}; do
        name=ppo$([ "${PPO_GATHER:-layer}" != layer ] && echo _$gather)
        rm -rf /tmp/runs/$name; runs+=(/tmp/runs/$name)
        stage $name ${PPO_LIMIT:-420} python3 -m dsrl.cli train --config configs/gpu_colocate.yaml \
          --model.path /tmp/models/${PPO_MODEL:-1.5b} --algorithm.advantage gae --algorithm.kl_coef 0.01 \
          --critic.lr 1e-6 --trainer.total_steps ${PPO_STEPS:-4} --logging.tensorboard $TB --logging.run_dir /tmp/runs/$name \
          --trainer.gather_per_layer $([ $gather = layer ] && echo true || echo false) ${PPO_EXTRA:-}
        grep -a "\[dsrl\] step\|Error" "$OUT/$name.log" | sed 's/.*\[dsrl\]//' | tail -5 | tee -a "$SUMMARY"
        grep -a "final metrics" "$OUT/$name.log" | grep -o '"memory/[a-z_]*": [0-9.e-]*\|"timing/[a-z]*": [0-9.e-]*\|"critic/[a-z_]*": [0-9.e-]*\|"sync/probe_logprob_diff": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      done
      [ ${#runs[@]} = 2 ] && [ -f ${runs[0]}/final_metrics.json ] && [ -f ${runs[1]}/final_metrics.json ] \
        && python3 tools/step_report.py ${runs[0]} --against ${runs[1]} 2>&1 | tail -1 | tee -a "$SUMMARY"
      ;;
    readme)  # 1 GPU: docs/gpus.md as far as a machine with no internet goes: the machine's own environment
      # (its torch) takes the place of the new venv, and the other wheels are in /tmp/site, pruned (--no-index
      # --no-deps: SGLang declares packages the site leaves out, e.g. anthropic). Then the
      # first GPU run, a mid-run checkpoint exported with `dsrl export`, scored with `dsrl eval` (SGLang), and
      # SGLang's greedy tokens against transformers' on it.
      stage readme_install 300 bash -c 'export PIP_CONSTRAINT=$PWD/constraints-gpu.txt \
        && python3 -m pip install --no-index --no-build-isolation --no-deps -e ".[gpu]" && which dsrl'
      tail -3 "$OUT/readme_install.log" | tee -a "$SUMMARY"
      DSRL=$(command -v dsrl) || { note "no dsrl script: python3 -m dsrl.cli instead"; DSRL="python3 -m dsrl.cli"; }
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      stage readme_train ${README_LIMIT:-300} $DSRL train --config configs/toy_gpu.yaml \
        --trainer.total_steps ${README_STEPS:-40} --logging.save_every 20 --logging.tensorboard $TB
      grep -a "\[dsrl\] step" "$OUT/readme_train.log" | sed -n '1p;$p' | sed 's/.*\[dsrl\]//' | tee -a "$SUMMARY"
      grep -a "Error" "$OUT/readme_train.log" | tail -3 | tee -a "$SUMMARY"
      python3 tools/step_report.py runs/toy_gpu | tee -a "$SUMMARY"
      stage readme_export 120 $DSRL export --checkpoint runs/toy_gpu/checkpoints/step_20 --out /tmp/hf_step_20
      tail -1 "$OUT/readme_export.log" | tee -a "$SUMMARY"; ls /tmp/hf_step_20 | tr '\n' ' ' | tee -a "$SUMMARY"; echo
      stage readme_eval 300 $DSRL eval --config runs/toy_gpu/config.yaml --checkpoint runs/toy_gpu/checkpoints/step_20 \
        --eval.path examples/toy/test.jsonl
      grep -a "eval/\|Error" "$OUT/readme_eval.log" | tail -6 | tee -a "$SUMMARY"
      stage readme_greedy 300 python3 tools/gpu_greedy_check.py /tmp/hf_step_20 --new-tokens 4
      tail -3 "$OUT/readme_greedy.log" | tee -a "$SUMMARY"
      ;;
    custom_rollout)  # 1 GPU: the colocated toy with each response made in two SGLang requests (--rollout.rollout_fn)
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      stage custom_rollout 300 python3 -m dsrl.cli train --config configs/toy_gpu.yaml --rollout.rollout_fn tests._rollouts:two_pieces \
        --trainer.total_steps ${CUSTOM_STEPS:-30} --logging.tensorboard $TB --logging.run_dir /tmp/runs/custom_rollout
      grep -a "\[dsrl\] step" "$OUT/custom_rollout.log" | sed -n '1p;$p' | sed 's/.*\[dsrl\]//' | tee -a "$SUMMARY"
      grep -a "Error" "$OUT/custom_rollout.log" | tail -3 | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/custom_rollout.log" | grep -o '"sync/probe_logprob_diff": [0-9.e-]*\|"mismatch/[a-z_]*": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      ;;
    step)  # 1 GPU: a realistic colocated step (STEP_MODEL, 64 prompts x 8 samples x 512 new tokens), every phase
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      rm -rf /tmp/runs/step  # (a warm machine keeps the last run's tensorboard, which step_report would average in)
      stage step_${STEP_MODEL:-3b} ${STEP_LIMIT:-480} python3 -m dsrl.cli train --config configs/gpu_colocate.yaml \
        --model.path /tmp/models/${STEP_MODEL:-3b} --rollout.prompts_per_step 64 --rollout.n_samples 8 \
        --rollout.max_new_tokens 512 --rollout.mem_fraction_static ${STEP_MEM:-0.4} --trainer.micro_batch_size ${STEP_MICRO:-16} \
        --trainer.total_steps ${STEP_STEPS:-4} --logging.tensorboard $TB --logging.run_dir /tmp/runs/step ${STEP_EXTRA:-}
      grep -a "colocated memory\|\[dsrl\] step\|Error" "$OUT/step_${STEP_MODEL:-3b}.log" | sed 's/.*\[dsrl\]//' | tail -6 | tee -a "$SUMMARY"
      python3 tools/step_report.py /tmp/runs/step | tee -a "$SUMMARY"
      ;;
    lora)  # 1 GPU: LoRA colocated with SGLang (modes: adapter served on its own, merged; zero3 = merged on a base
      # partitioned by ZeRO-3, the path before the replicated base; before = merged, gathered per module, the path
      # before whole-layer gathering) against full fine-tuning (LORA_FULL_EXTRA: its flags alone);
      # LORA_EXTRA goes to every run. Last, one line per LoRA mode against full (tools/step_report.py --against).
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      for model in ${LORA_MODELS:-1.5b 3b}; do
        for mode in ${LORA_MODES:-full adapter merged}; do  # full first: the first run on a fresh machine compiles
          # SGLang's kernels (a LoRA run first reached no step in 200 s at 3B); list full first in LORA_MODES too
          case $mode in
            full) lora="${LORA_FULL_EXTRA:-}" ;;
            before) lora="--model.lora_rank ${LORA_RANK:-16} --trainer.lr 1e-5 --sync.lora merged --trainer.gather_per_layer false" ;;
            zero3) lora="--model.lora_rank ${LORA_RANK:-16} --trainer.lr 1e-5 --sync.lora merged --model.lora_base partitioned" ;;
            *) lora="--model.lora_rank ${LORA_RANK:-16} --trainer.lr 1e-5 --sync.lora $mode" ;;
          esac
          run=/tmp/runs/lora_${model}_$mode
          rm -rf $run
          stage lora_${model}_$mode ${LORA_LIMIT:-360} python3 -m dsrl.cli train --config configs/gpu_colocate.yaml \
            --model.path /tmp/models/$model --rollout.prompts_per_step ${LORA_PROMPTS:-16} --rollout.n_samples 8 \
            --rollout.max_new_tokens 256 --trainer.total_steps ${LORA_STEPS:-3} --logging.tensorboard $TB \
            --logging.run_dir $run $lora ${LORA_EXTRA:-}
          grep -a "LoRA rank\|LoRA: the frozen\|ZeRO-3 gathers\|Error" "$OUT/lora_${model}_$mode.log" | sed 's/.*\[dsrl\]//' | tail -3 | tee -a "$SUMMARY"
          grep -a "final metrics" "$OUT/lora_${model}_$mode.log" | grep -o '"sync/bytes": [0-9.e-]*\|"sync/seconds": [0-9.e-]*\|"timing/sync": [0-9.e-]*\|"timing/step": [0-9.e-]*\|"timing/update": [0-9.e-]*\|"memory/[a-z_]*peak_gb": [0-9.e-]*\|"sync/probe_logprob_diff": [0-9.e-]*\|"mismatch/logprob_abs_diff": [0-9.e-]*\|"reward/mean": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
          [ "$TB" = true ] && python3 tools/step_report.py $run 2>&1 | grep -a "sync\|step " | head -4 | tee -a "$SUMMARY"
        done
        for mode in ${LORA_MODES:-adapter merged}; do  # (against a full run of this machine's, maybe an earlier call's)
          [ $mode != full ] && [ -f /tmp/runs/lora_${model}_$mode/final_metrics.json ] \
            && [ -f /tmp/runs/lora_${model}_full/final_metrics.json ] \
            && python3 tools/step_report.py /tmp/runs/lora_${model}_$mode --against /tmp/runs/lora_${model}_full 2>&1 | tail -1 | tee -a "$SUMMARY"
        done
      done
      ;;
    offload)  # 1 GPU: colocated steps with the trainer's states kept on the GPU (auto's choice when they fit) vs moved
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      for mode in ${OFFLOAD_MODES:-auto always}; do
        stage offload_$mode ${OFFLOAD_LIMIT:-300} python3 -m dsrl.cli train --config configs/gpu_colocate.yaml \
          --model.path /tmp/models/${OFFLOAD_MODEL:-1.5b} --trainer.total_steps ${OFFLOAD_STEPS:-6} \
          --trainer.offload_states $mode --logging.tensorboard $TB --logging.run_dir /tmp/runs/offload_$mode
        grep -a "colocated memory" "$OUT/offload_$mode.log" | sed 's/.*\[dsrl\]//' | tee -a "$SUMMARY"
        grep -a "final metrics" "$OUT/offload_$mode.log" | grep -o '"timing/[a-z_]*": [0-9.e-]*\|"memory/[a-z]*_peak_gb": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      done
      ;;
    ray_colocate)  # 1 GPU: the colocated toy run, its SGLang server placed by Ray on the trainer's GPU (CUDA IPC)
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      timeout 120 python3 -m ray.scripts.scripts start --head --num-gpus 1 --num-cpus 8 \
        --include-dashboard false --disable-usage-stats > "$OUT/ray_start.log" 2>&1 || note "ray start failed (ray_start.log)"
      stage ray_colocate 480 python3 -m dsrl.cli train --config configs/toy_gpu.yaml --rollout.fleet ray \
        --trainer.total_steps ${RAY_STEPS:-30} --logging.tensorboard $TB --logging.run_dir /tmp/runs/ray_colocate
      timeout 60 python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
      grep -a "on Ray node\|\[dsrl\] step\|Error" "$OUT/ray_colocate.log" | sed 's/.*\[dsrl\]//' | sed -n '1,2p;$p' | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/ray_colocate.log" | grep -o '"sync/[a-z_]*": [0-9.e-]*\|"timing/sync[a-z_]*": [0-9.e-]*\|"reward/mean": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      ;;
    routes)  # 2 GPUs, one SGLang server each: a GRPO group on one server (route group) vs spread (least_loaded)
      stage routes 420 python3 tools/bench_rollout.py --model /tmp/models/${ROUTES_MODEL:-0.5b} --engine sglang --servers 2 \
        --routes --requests ${ROUTES_REQUESTS:-512} --n 8 --prompt-len ${ROUTES_PROMPT:-2048} --new-tokens 64 \
        --server-args '{"attention_backend": "triton", "sampling_backend": "pytorch"}'
      grep -a "^routes" "$OUT/routes.log" | tee -a "$SUMMARY"
      ;;
    agent_toy)  # 1 GPU: the toy agent task (multi-turn episodes) colocated with SGLang
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      stage agent_toy ${AGENT_LIMIT:-420} python3 -m dsrl.cli train --config configs/toy_gpu_agent.yaml \
        --trainer.total_steps ${AGENT_STEPS:-150} --logging.tensorboard $TB --logging.run_dir /tmp/runs/agent_toy
      grep -a "\[dsrl\] step" "$OUT/agent_toy.log" | sed -n '1p;$p' | sed 's/.*\[dsrl\]//' | tee -a "$SUMMARY"
      grep -a "Error" "$OUT/agent_toy.log" | tail -3 | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/agent_toy.log" | grep -o '"agent/[a-z_]*": [0-9.e-]*\|"mismatch/[a-z_]*": [0-9.e-]*\|"sync/probe_logprob_diff": [0-9.e-]*\|"timing/step": [0-9.e-]*\|"reward/mean": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      ;;
    agent_calc)  # 1 GPU: the calculator environment, a random-init 0.5B chat model (MODELS must include 0.5b-chat)
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      stage agent_calc ${CALC_LIMIT:-480} python3 -m dsrl.cli train --config configs/gpu_calculator_agent.yaml \
        --rollout.env_args '{"scripted_calls": 1}' --trainer.total_steps ${CALC_STEPS:-5} --logging.tensorboard $TB \
        --logging.run_dir /tmp/runs/agent_calc ${CALC_EXTRA:-}
      grep -a "\[dsrl\] step\|Error\|eval at" "$OUT/agent_calc.log" | sed 's/.*\[dsrl\]//' | tail -4 | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/agent_calc.log" | grep -o '"agent/[a-z_]*": [0-9.e-]*\|"mismatch/[a-z_]*": [0-9.e-]*\|"timing/[a-z]*": [0-9.e-]*\|"response/length_mean": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      python3 -c "import json; r = [json.loads(l) for l in open('/tmp/runs/agent_calc/generations.jsonl')][-1]; print('episode:', json.dumps(r['episode'])[:1500])" 2>&1 | tee -a "$SUMMARY"
      ;;
    bench_agent)  # 1 GPU: episodes of 1-16 turns at equal model tokens against single responses and their raw
      # floors (tools/bench_agent.py), once per SGLang --schedule-policy in BENCH_AGENT_POLICIES (SGLang's default: fcfs)
      # BENCH_AGENT_MIXED="false true": each policy also with SGLang's --enable-mixed-chunk (a new turn's prefill rides
      # in the running decode batch instead of pausing it)
      for policy in ${BENCH_AGENT_POLICIES:-fcfs}; do for mixed in ${BENCH_AGENT_MIXED:-false}; do
        policy_name=$policy$([ $mixed = true ] && echo _mixed)
        stage bench_agent_$policy_name ${BENCH_AGENT_LIMIT:-170} python3 tools/bench_agent.py \
          --model /tmp/models/${BENCH_AGENT_MODEL:-0.5b-chat} --engine sglang --tokens ${BENCH_AGENT_TOKENS:-1024} \
          --episodes ${BENCH_AGENT_EPISODES:-256} --turns ${BENCH_AGENT_TURNS:-8 2 4 16} --repeats ${BENCH_AGENT_REPEATS:-1} \
          --schedule-policy $policy ${BENCH_AGENT_EXTRA:-} --server-args '{"attention_backend": "triton", '\
'"sampling_backend": "pytorch", "mem_fraction_static": 0.6, "enable_mixed_chunk": '$mixed'}'
        grep -a "^model tokens per episode\|^ *turns \|^ *single \|^ *[0-9]" "$OUT/bench_agent_$policy_name.log" | tail -10 | tee -a "$SUMMARY"
        grep -a "Error" "$OUT/bench_agent_$policy_name.log" | tail -3 | tee -a "$SUMMARY"
      done; done
      ;;
    agent_calc8)  # 1 GPU: the calculator agent on the 1.5B chat shape (MODELS must include 1.5b-chat), colocated: 8 turns,
      # the first 7 calling the calculator (scripted_calls 7), the step's phases and the share of an episode between turns
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      rm -rf /tmp/runs/agent_calc8
      stage agent_calc8 ${CALC8_LIMIT:-200} python3 -m dsrl.cli train --config configs/gpu_calculator_agent.yaml \
        --model.path /tmp/models/${CALC8_MODEL:-1.5b-chat} --agent.max_turns 8 --rollout.max_new_tokens ${CALC8_TOKENS:-64} \
        --agent.max_episode_tokens 2048 --rollout.env_args '{"scripted_calls": 7}' --trainer.total_steps ${CALC8_STEPS:-3} \
        --eval.path null --logging.export_hf false --logging.tensorboard $TB --logging.run_dir /tmp/runs/agent_calc8 ${CALC8_EXTRA:-}
      grep -a "\[dsrl\] step\|Error" "$OUT/agent_calc8.log" | sed 's/.*\[dsrl\]//' | tail -4 | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/agent_calc8.log" | grep -o '"agent/[a-z_]*": [0-9.e-]*\|"timing/[a-z]*": [0-9.e-]*\|"rollout/tokens_per_s": [0-9.e-]*\|"response/length_mean": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      [ "$TB" = true ] && python3 tools/step_report.py /tmp/runs/agent_calc8 2>&1 | tee -a "$SUMMARY"
      ;;
    bench_trainer)  # 1 GPU: the trainer before/after micro-batches by tokens, packing and chunked log-probs
      stage bench_trainer ${BENCH_TRAINER_LIMIT:-420} python3 tools/bench_trainer.py --model /tmp/models/${BENCH_TRAINER_MODEL:-3b} \
        --samples ${BENCH_TRAINER_SAMPLES:-128} --max-len ${BENCH_TRAINER_MAX_LEN:-2048} --micro ${BENCH_TRAINER_MICRO:-8} \
        --budget ${BENCH_TRAINER_BUDGET:-16384} --repeats ${BENCH_TRAINER_REPEATS:-1} ${BENCH_TRAINER_EXTRA:-}
      grep -a "^model \|^ *lengths \|^ *longtail \|^ *uniform \|Error" "$OUT/bench_trainer.log" | tail -40 | tee -a "$SUMMARY"
      grep -a "^summary" "$OUT/bench_trainer.log" | tee -a "$SUMMARY"
      ;;
    peers)  # verl 0.9.1 and dsrl on one model, parquet, reward and batch (tools/peers/peers.py), on PEERS_GPUS GPUs.
      # verl's own stack (SGLang 0.5.12, transformers 5.9.0): .peers/verl_stack.tar.xz (STACK=own DEST=.peers bash
      # tools/peers/build_site.sh), unpacked into /tmp/verlstack once; too big to travel beside .gpu, it comes in a call
      # of its own (PEERS_UNPACK_ONLY=1: unpack, check its imports, stop). Without it, the layered
      # .peers/verl_site.tar.xz over the dsrl site, as before issue 53. PEERS_PAIRS="auto recompute" runs matched
      # pairs PEERS_REPEATS times in alternating order from repeat PEERS_REPEAT_FROM (else PEERS_RUNS back to back).
      # verl takes ~4 min to its first step and ~1 min for that step (compilation, warm-up).
      CHECK=${PEERS_UNPACK_ONLY:-0}
      if [ -f .peers/verl_stack.tar.xz ] && [ ! -f /tmp/verlstack/.ok ]; then
        mkdir -p /tmp/verlstack && tar xJf .peers/verl_stack.tar.xz -C /tmp/verlstack && touch /tmp/verlstack/.ok
        CHECK=1
      fi
      VSITE=/tmp/verlstack
      if [ ! -f /tmp/verlstack/.ok ]; then
        VSITE=/tmp/verlsite
        [ -f /tmp/verlsite/.ok ] || { mkdir -p /tmp/verlsite && tar xJf ${VERL_SITE:-.peers/verl_site.tar.xz} -C /tmp/verlsite \
          && touch /tmp/verlsite/.ok; } || note "no verl site (.peers/verl_stack.tar.xz or .peers/verl_site.tar.xz)"
      fi
      if [ "${PEERS_VERL_PATCH:-0}" = 1 ]; then  # verl 0.9.1's separate_async with hybrid_engine=false dies in its
        # setup on `logger.info(..., flush=True)` (2026-11-28): drop that argument alone, for PEERS_EXTRA="--verl-overrides
        # actor_rollout_ref.hybrid_engine=false" (its trainer's GPUs without replicas; docs/benchmarks/verl.md)
        F=$VSITE/verl/trainer/ppo/v1/trainer_separate_async.py
        if grep -q '^ *flush=True,$' "$F"; then sed -i '/^ *flush=True,$/d' "$F" \
          && note "verl patched: trainer_separate_async.py without its logger.info(..., flush=True)"
        else note "verl patch: no flush=True line in trainer_separate_async.py (patched before on this machine?)"; fi
      fi
      if [ "$VSITE" = /tmp/verlstack ] && [ "$CHECK" = 1 ]; then  # once a machine: its imports without the dsrl site
        PYTHONPATH=/tmp/verlstack:$PWD:$PWD/tools/peers timeout 300 python3 -c "import verl.trainer.main_ppo, \
verl.workers.rollout.sglang_rollout.async_sglang_server, verl.experimental.agent_loop.single_turn_agent_loop, \
verl_sampler, verl_agent, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, \
sglang.srt.model_executor.model_runner, sglang, transformers, flashinfer, sgl_kernel; \
print('verl stack: verl', verl.__version__, 'sglang', sglang.__version__, 'transformers', transformers.__version__)" \
          2>&1 | tail -3 | tee -a "$SUMMARY"
        # and verl's own checks of every setting the harness gives it (hydra, validate_config, its dataclasses)
        PYTHONPATH=/tmp/verlstack:$PWD:$PWD/tools/peers timeout 300 python3 tools/peers/verl_check.py \
          --gpus ${PEERS_GPUS:-1} > "$OUT/verl_check.log" 2>&1; grep -a "refused\|taken\|Error" "$OUT/verl_check.log" \
          | grep -v ": ok$" | tail -4 | tee -a "$SUMMARY"
      fi
      [ "${PEERS_UNPACK_ONLY:-0}" = 1 ] && continue
      if [ -n "${PEERS_PAIRS:-}" ]; then
        WHAT="--pairs $PEERS_PAIRS --repeats ${PEERS_REPEATS:-3} --repeat-from ${PEERS_REPEAT_FROM:-0}"
      else
        WHAT="--runs ${PEERS_RUNS:-verl dsrl}"
      fi
      stage peers ${PEERS_LIMIT:-540} python3 tools/peers/peers.py --model /tmp/models/${PEERS_MODEL:-1.5b} $WHAT \
        --gpus ${PEERS_GPUS:-1} --workload ${PEERS_WORKLOAD:-step} --limits ${PEERS_LIMITS:-330 170} \
        --steps ${PEERS_STEPS:-3} --verl-site $VSITE --out "$OUT" --budget $((${PEERS_LIMIT:-540} - 20)) ${PEERS_EXTRA:-}
      grep -a "^| \|dsrl step\|dsrl / verl" "$OUT/peers.log" | tail -12 | tee -a "$SUMMARY"
      # A side that died without a traceback (verl's 7B server on a 128 GiB host, 2026-11-28): the kernel's word on it
      dmesg 2>/dev/null | grep -a -i "out of memory\|killed process" | tail -4 | tee -a "$SUMMARY"
      ;;
    rm)  # 1 GPU: GRPO 64x8x512 colocated with SGLang, rewarded by a 1.5B reward model on its own SGLang server
      # (--is-embedding, /classify) on the same GPU: three tenants. The memory plan, the phases, and the reward model's
      # scoring time (reward/model_seconds) with the part of it left after the last group generated (model_exposed_s)
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      rm -rf /tmp/runs/rm
      stage rm ${RM_LIMIT:-420} python3 -m dsrl.cli train --config configs/gpu_colocate.yaml \
        --model.path /tmp/models/${RM_POLICY:-1.5b} --reward_model.path /tmp/models/${RM_MODEL:-1.5b-rm} \
        --reward_model.w_rule 0 --reward_model.server_args '{"attention_backend": "triton"}' \
        --rollout.prompts_per_step 64 --rollout.n_samples 8 --rollout.max_new_tokens 512 \
        --rollout.mem_fraction_static ${RM_MEM:-0.35} --reward_model.mem_fraction_static ${RM_RM_MEM:-0.15} \
        --trainer.total_steps ${RM_STEPS:-3} --logging.tensorboard $TB --logging.run_dir /tmp/runs/rm ${RM_EXTRA:-}
      grep -a "colocated memory\|reward server ready\|\[dsrl\] step\|Error" "$OUT/rm.log" | sed 's/.*\[dsrl\]//' | tail -7 | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/rm.log" | grep -o '"reward/[a-z_]*": [0-9.e-]*\|"timing/[a-z]*": [0-9.e-]*\|"memory/[a-z]*_peak_gb": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      python3 tools/step_report.py /tmp/runs/rm | tee -a "$SUMMARY"
      tail -c 100000 /tmp/runs/rm/logs/reward_server_0.log > "$OUT/rm_reward_server.log" 2>/dev/null
      ;;
    split_hang)  # 3 GPUs: the first-sync hang of 2 trainer ranks at its smallest, as before the fix and now
      stage split_hang 120 python3 tools/gpu_split_hang.py --limit "${SPLIT_LIMIT:-40}"
      grep -a "^split hang" "$OUT/split_hang.log" | tee -a "$SUMMARY"
      ;;
    placements)  # 4 GPUs: every placement of the design on one host, one line each (PLACEMENTS picks them; PL_MODEL,
      # PL_STEPS, PL_LIMIT; PL_EXTRA: flags for every run, after the others, e.g. a workload, a checkpoint, the export). SGLang without CUDA graphs: it starts in ~30 s instead of 50-130 (these runs check, the
      # speed stages measure). ray2x2 needs Ray: carry .gpu/ray_site.tar.xz (tools/peers/build_site.sh, RAY_ONLY=1).
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      PL_SERVER_ARGS=${PL_SERVER_ARGS:-'{"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": true}'}
      # Waves, split by "|", run one after another; the placements of a wave run side by side, each on the 4 GPUs in
      # another order (a disaggregated run's ranks take the first two it sees, its servers the last two), with
      # small servers (PL_MEM of each GPU): they check placements, the speed stages time them alone.
      rotations=("" 2,3,0,1 1,2,3,0 3,0,1,2 0,2,1,3 1,3,0,2)
      IFS='|' read -ra waves <<< "${PLACEMENTS:-launcher dis2x2 dis2_tp2 off2x2 async2x2_partial async2x2_pause|colo4 colo4_tp2 ray2x2}"
      for wave in "${waves[@]}"; do
        k=0
        for p in $wave; do
          case $p in colo*|ray*|*4x4*) placement "$p" & ;; *) placement "$p" "${rotations[$((k % 6))]}" & k=$((k + 1)) ;; esac
          sleep 1
        done
        wait
        timeout 60 python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
        pkill -9 -f "sglang|dsrl\.(train|cli)|deepspeed\.launcher" 2>/dev/null; sleep 2  # a failed run's leftovers
      done
      ;;
    update_memory)  # 1 GPU: the update's peak and what it keeps per micro-batch at 64 and 256 samples (issue 60)
      stage update_memory ${UM_LIMIT:-240} python3 tools/update_memory.py --model /tmp/models/${UM_MODEL:-1.5b} \
        --samples ${UM_SAMPLES:-64 256 64}
      grep -a "^samples\|^  alive" "$OUT/update_memory.log" | tee -a "$SUMMARY"
      ;;
    moments)  # 1 GPU: Adam's moments off the GPU and back by the plan's share, bit for bit (tools/gpu_moments.py); then
      # the colocated toy with a share of them (MOMENTS_MEM, mem_fraction_static: 0.78 at 1.5B gave 0.3, 0.88 at 0.5B
      # 0.43) to a checkpoint at step 4, and the same command to step 6, resumed (its moments all move at start-up, the
      # share after). The 1.5B checkpoint (~28 GB) took over 30 s at ~590 MB/s, and a run's 140 s did not reach its
      # end (2026-11-28): MOMENTS_MODEL=0.5b, whose runs took 198 s and 139 s
      stage moments ${MOMENTS_LIMIT:-120} python3 tools/gpu_moments.py --model /tmp/models/${MOMENTS_MODEL:-1.5b}
      grep -a "moment tensors\|^share\|^resumed\|moments check\|Error" "$OUT/moments.log" | cut -c1-300 | tee -a "$SUMMARY"
      rm -rf /tmp/runs/moments
      for steps in 4 6; do
        stage moments_to_$steps ${MOMENTS_RUN_LIMIT:-220} python3 -m dsrl.cli train --config configs/gpu_colocate.yaml \
          --model.path /tmp/models/${MOMENTS_MODEL:-1.5b} --rollout.mem_fraction_static ${MOMENTS_MEM:-0.78} \
          --trainer.offload_states moments --trainer.total_steps $steps --logging.save_every 4 \
          --logging.export_hf false --logging.run_dir /tmp/runs/moments
        grep -a "memory plan\|resumed from\|\[dsrl\] step\|Error\|WARNING.*moments" "$OUT/moments_to_$steps.log" \
          | sed 's/.*\[dsrl\]//' | cut -c1-240 | tail -8 | tee -a "$SUMMARY"
        grep -ao '"timing/release": [0-9.]*\|"timing/sync_offload": [0-9.]*\|"memory/generate_device_used_gb": [0-9.]*' \
          "$OUT/moments_to_$steps.log" | tail -3 | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      done
      ;;
    soak)  # `dsrl train` on the tail workload for SOAK_STEPS steps, one line per run (issue 60; tools/soak.py). SOAK_RUNS:
      # NAME:GPUS[:split][:killK|:synckillK (in the sync after step K)][:stepsN] each, e.g. "colo1:1 colo2_kill:2:kill5:steps14 async2:2:split"; SOAK_EXTRA: flags for every
      # run (after the workload's), SOAK_EXTRA_<NAME> one run's; SOAK_MODEL (1.5b) or SOAK_MODEL_<NAME>, a model of
      # MODELS; SOAK_LIMIT: seconds a run
      for spec in ${SOAK_RUNS:-colo1:1}; do
        IFS=: read -r name gpus opt1 opt2 opt3 <<< "$spec"
        flags=(--gpus "$gpus" --steps "${SOAK_STEPS:-50}" --limit "${SOAK_LIMIT:-500}")
        for o in $opt1 $opt2 $opt3; do
          case $o in split) flags+=(--split) ;; kill*) flags+=(--kill-at "${o#kill}" --kill-server 0) ;;
            synckill*) flags+=(--kill-at "${o#synckill}" --kill-in-sync --kill-server 0) ;;
            steps*) flags+=(--steps "${o#steps}") ;; esac
        done
        extra_var="SOAK_EXTRA_$name" model_var="SOAK_MODEL_$name"
        stage "soak_$name" $((${SOAK_LIMIT:-500} + 60)) python3 tools/soak.py --model /tmp/models/${!model_var:-${SOAK_MODEL:-1.5b}} \
          --name "$name" --out "$OUT" "${flags[@]}" -- ${SOAK_EXTRA:-} ${!extra_var:-}
        grep -a -A4 "^soak $name" "$OUT/soak_$name.log" | tee -a "$SUMMARY"
        grep -a "Error\|error:" "$OUT/run_$name.log" | tail -3 | cut -c1-300 | tee -a "$SUMMARY"
        grep -a "memory plan" "$OUT/run_$name.log" | head -1 | cut -c1-800 | tee -a "$SUMMARY"
        mkdir -p "$OUT/soak_servers"; for f in /tmp/soak/$name/run/logs/*server_*.log; do
          [ -f "$f" ] && tail -c 300000 "$f" > "$OUT/soak_servers/${name}_$(basename "$f")"; done
        rm -rf /tmp/soak/$name/run/checkpoints /tmp/soak/$name/run/hf  # (7B's checkpoint is ~110 GB: the disk is 235)
        pkill -9 -f "sglang|dsrl\.(train|cli)|deepspeed\.launcher" 2>/dev/null; sleep 2
      done
      # the mismatch of the runs tools/baselines/mismatch.json has a bound for (by name: moe4, moe4_noreplay, moe48)
      python3 tools/baselines.py check tools/baselines/mismatch.json "$OUT/soak.json" | tee -a "$SUMMARY"
      ;;
    gate)  # 1 GPU (issue 89): pair `auto`'s dsrl side on the 1.5B `tail` workload (tools/peers/peers.py, run
      # dsrl-auto: its records' command), 11 steps, then each figure of its steady steps (2-11) against the committed
      # baseline: a step or phase more than 15% slower, the update's peak more than 1% higher, the sync's GB/s more than
      # 15% slower, the mismatch over its bound are named, and the stage fails (tools/baselines.py). GATE_SEED: 0 (the
      # baseline's repeats ran seeds 0-2, the same prompts a step)
      # (a cold machine's start-up took ~270 s of GATE_LIMIT=360 on 2026-12-02: 3 of 11 steps; carry the jitcache)
      rm -rf /tmp/gate
      stage gate_run ${GATE_LIMIT:-420} python3 tools/peers/peers.py --model /tmp/models/1.5b --workload tail \
        --runs dsrl-auto --steps 11 --seeds ${GATE_SEED:-0} --limits $((${GATE_LIMIT:-420} - 40)) --out /tmp/gate \
        --budget $((${GATE_LIMIT:-420} - 20))
      cp /tmp/gate/peers.json "$OUT/gate_peers.json" 2>/dev/null
      stage gate 30 python3 tools/baselines.py check tools/baselines/gate_tail_1.5b.json /tmp/gate/peers.json
      cat "$OUT/gate.log" | tee -a "$SUMMARY"
      ;;
    fp8)  # 1 GPU (issue 64): FP8 rollout against bf16 on peers' `tail` workload, same model and GPU, back to back:
      # the generate phase, the sync's bytes and seconds (sync/seconds: send to version check), the mismatch and the
      # FP8 run's probe at its first and last sync (tools/peers/peers.py FP8_FLAGS). 1.5B: both runs in one call. 7B:
      # FP8_MODEL=7b FP8_RUNS="dsrl-moments dsrl-moments-fp8", or one run a call on the held machine (the records
      # gather in /tmp/fp8_peers/<model>/peers.json, and each call prints every run there). SGLang's block-FP8 GEMM on
      # Hopper is DeepGEMM's where the `deep_gemm` package imports (sgl-deep-gemm, which the site lacks: its wheel
      # travels in .whl, `pip download --no-deps sgl-deep-gemm==0.1.5.post1 -d .whl`, carry .whl), else Triton's; the
      # summary says which. DeepGEMM JIT-compiles at a server's first start on a machine (SGLang warns of 10-20 min;
      # fast warm-up compiles fewer shapes) into /tmp/jitcache, whose archive comes back: carry it to skip that;
      # FP8_DEEPGEMM=0 runs Triton's block-FP8 GEMM even where DeepGEMM imports
      M=${FP8_MODEL:-1.5b}; mkdir -p /tmp/fp8_peers/$M
      FP8_ENV=(env SGLANG_DG_CACHE_DIR=/tmp/jitcache/deep_gemm SGLANG_JIT_DEEPGEMM_FAST_WARMUP=1
               SGLANG_ENABLE_JIT_DEEPGEMM=${FP8_DEEPGEMM:-1})
      "${FP8_ENV[@]}" python3 -c "from sglang.srt.layers.deep_gemm_wrapper.configurer import ENABLE_JIT_DEEPGEMM as dg
print('SGLang block-FP8 GEMM:', 'DeepGEMM' if dg else 'Triton (deep_gemm does not import, or FP8_DEEPGEMM=0)')" 2>&1 \
        | tail -1 | tee -a "$SUMMARY"
      # (without them each FP8 server's start compiled 2 x 2,560 shapes, ~150 s at 7B, and the runs hit their limits)
      echo "DeepGEMM kernels cached: $(find /tmp/jitcache/deep_gemm -type f 2>/dev/null | wc -l) files" \
        "(none: carry .gpu/jitcache.tar.gz, or allow each FP8 run ~150 s more)" | tee -a "$SUMMARY"
      stage fp8_$M ${FP8_LIMIT:-500} "${FP8_ENV[@]}" python3 tools/peers/peers.py --model /tmp/models/$M --workload tail \
        --runs ${FP8_RUNS:-dsrl dsrl-fp8} --steps ${FP8_STEPS:-4} --limits ${FP8_RUN_LIMIT:-230} --out /tmp/fp8_peers/$M \
        --budget $((${FP8_LIMIT:-500} - 20))
      cp /tmp/fp8_peers/$M/peers.json "$OUT/fp8_${M}_peers.json" 2>/dev/null
      for a in /tmp/fp8_peers/$M/logs_*.tar.gz; do [ -f "$a" ] && tar xzf "$a" -C "$OUT"; done  # (into logs.tar.gz)
      for f in "$OUT"/dsrl*_tail_*.log; do  # a run that failed says why here (a 7B run died of its last reload so)
        [ -f "$f" ] && grep -a "Error" "$f" | tail -1 | cut -c1-300 | sed "s|^|$(basename "$f"): |" | tee -a "$SUMMARY"
      done
      python3 - /tmp/fp8_peers/$M/peers.json <<'PY' 2>&1 | tee -a "$SUMMARY"
import json, sys
for name, run in json.load(open(sys.argv[1]))["runs"].items():
    steps = run.get("steps", [])
    later = steps[1:] or steps
    def mean(key):
        values = [s[key] for s in later if key in s]
        return sum(values) / len(values) if values else float("nan")
    probe = [s["sync/probe_logprob_diff"] for s in steps if "sync/probe_logprob_diff" in s]
    print(f"{name}: {len(later)} steps | generate {mean('timing/generate'):.2f} s of {mean('timing/step'):.2f} s | "
          f"sync {mean('sync/bytes') / 1e9:.2f} GB in {mean('sync/seconds'):.3f} s (timing/sync "
          f"{mean('timing/sync'):.3f} s) | mismatch {mean('mismatch/logprob_abs_diff'):.4f} | probe {probe} | "
          f"reward {mean('reward/mean'):.3f} | rc {run.get('rc')}")
PY
      python3 tools/baselines.py check tools/baselines/mismatch.json /tmp/fp8_peers/$M/peers.json | tee -a "$SUMMARY"
      ;;
    fp8_toy)  # 1 GPU (issue 64): the GPU toy, bf16 against FP8 rollout, FP8_TOY_SEEDS (2 runs ~130 s each a seed).
      # SGLang's FP8 layers split weights into 128-row blocks: the toy at hidden 128 and 4 KV heads (q, k, v 128 rows
      # each), both precisions on it. FP8_TOY_ARCH=llama|qwen3 serves it as that architecture (the toy is Qwen2), and
      # FP8_TOY_KV=fp8_e4m3 with an FP8 KV cache: the loaders that rename the KV scales (dsrl.fp8.RENAMES_KV_SCALES).
      # llama: refused since 2026-11-28 (its loader drops block scales: dsrl.fp8.RENAMES_BLOCK_SCALES)
      mkdir -p /tmp/models/toy128 && cp examples/toy/model/tokenizer* /tmp/models/toy128/
      python3 -c "import json; c = json.load(open('examples/toy/model/config.json')); c.update(hidden_size=128, \
intermediate_size=256, num_key_value_heads=4); arch = {'llama': 'LlamaForCausalLM', 'qwen3': 'Qwen3ForCausalLM'}; \
a = '${FP8_TOY_ARCH:-qwen2}'; c.update(model_type=a, architectures=[arch[a]], head_dim=32) if a in arch else None; \
json.dump(c, open('/tmp/models/toy128/config.json', 'w'))"
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      kv=(); [ -n "${FP8_TOY_KV:-}" ] && kv=(--rollout.server_args "{\"attention_backend\": \"triton\", \
\"sampling_backend\": \"pytorch\", \"disable_cuda_graph\": true, \"kv_cache_dtype\": \"$FP8_TOY_KV\"}")
      for seed in ${FP8_TOY_SEEDS:-0}; do for prec in ${FP8_TOY_PRECISIONS:-bf16 fp8}; do
        rm -rf /tmp/runs/fp8_toy_${prec}_s$seed
        extra=("${kv[@]}"); [ $prec = fp8 ] && extra+=(--sync.probe_tolerance null)  # (toy_gpu.yaml's 0.01: bf16's)
        stage fp8_toy_${prec}_s$seed ${FP8_TOY_LIMIT:-240} env SGLANG_DG_CACHE_DIR=/tmp/jitcache/deep_gemm \
          SGLANG_JIT_DEEPGEMM_FAST_WARMUP=1 python3 -m dsrl.cli train --config configs/toy_gpu.yaml \
          --model.path /tmp/models/toy128 --rollout.precision $prec --seed $seed --trainer.total_steps ${FP8_TOY_STEPS:-80} \
          --logging.tensorboard $TB --logging.run_dir /tmp/runs/fp8_toy_${prec}_s$seed "${extra[@]}"
        grep -a "\[dsrl\] step" "$OUT/fp8_toy_${prec}_s$seed.log" | sed -n '1p;$p' | sed 's/.*\[dsrl\]//' | tee -a "$SUMMARY"
        grep -a "Error" "$OUT/fp8_toy_${prec}_s$seed.log" | tail -3 | tee -a "$SUMMARY"
        grep -a "final metrics" "$OUT/fp8_toy_${prec}_s$seed.log" | grep -o '"sync/bytes": [0-9.e-]*\|"sync/probe_logprob_diff": [0-9.e-]*\|"mismatch/logprob_abs_diff": [0-9.e-]*\|"reward/mean": [0-9.e-]*' | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
        PYTHONPATH=tools/peers:$PYTHONPATH python3 -c "import report, sys; steps = report.dsrl_steps(__import__('pathlib')\
.Path(sys.argv[1])); print('mismatch by step:', [round(s.get('mismatch/logprob_abs_diff', -1), 4) for s in steps])" \
          /tmp/runs/fp8_toy_${prec}_s$seed 2>&1 | tail -1 | tee -a "$SUMMARY"  # (a KV scale lost at a sleep: a jump)
      done; done
      ;;
    vl)  # 1 GPU (issue 88): a random-init Qwen2.5-VL-3B shape (MODELS: vl-3b) colocated on geo3k-like rows of one picture
      # of 224-448 px each (MODELS: vl-data; 64-256 image tokens a prompt), 10 steps, every sync probe-checked (its probe
      # has an image too); then (VL_RUNS) its text-only twin, the 3B language model (MODELS: 3b) on the same prompts
      # without their pictures. Per run: the steady steps and phases, the sync's bytes and seconds, the probe's diff, the
      # mismatch and the prompts' mean length (the runs' difference: the image tokens a prompt). A cold machine took
      # 130 s to start the VL server (2026-12-02; the text twin's 80 s): VL_LIMIT 420 for the 10 steps
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      for run in ${VL_RUNS:-vl text}; do
        model=/tmp/models/vl-3b data=/tmp/models/vl-data/train.parquet
        [ $run = text ] && model=/tmp/models/3b data=/tmp/models/vl-data/train.jsonl
        # (the vision tower's attention: SGLang's default is FA3, whose kernels .gpu's site prunes from sgl_kernel)
        mm=(--rollout.server_args '{"attention_backend": "triton", "sampling_backend": "pytorch", "mm_attention_backend": "triton_attn"}')
        rm -rf /tmp/runs/vl_$run
        stage vl_$run ${VL_LIMIT:-420} python3 -m dsrl.cli train --config configs/gpu_colocate.yaml --model.path $model \
          --data.train_path $data --trainer.total_steps 10 --sync.verify probe --logging.tensorboard $TB \
          --logging.export_hf false --logging.run_dir /tmp/runs/vl_$run "${mm[@]}"
        note "vl $run: $(python3 tools/step_report.py --line /tmp/runs/vl_$run 2>/dev/null || grep -a 'Error\|error:' \
          "$OUT/vl_$run.log" | tail -1 | cut -c1-200)"
        grep -a "final metrics" "$OUT/vl_$run.log" | grep -o '"prompt/length_mean": [0-9.e-]*\|"sync/bytes": [0-9.e-]*\|"sync/seconds": [0-9.e-]*\|"sync/probe_logprob_diff": [0-9.e-]*\|"mismatch/logprob_abs_diff": [0-9.e-]*' \
          | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      done
      ;;
    opd)  # 1 GPU (issue 87): on-policy distillation on the GPU toy, the reverse KL to a teacher alone as the advantage;
      # the teacher (.teacher/hf, carried: the CPU toy trained by `dsrl train --config configs/toy_cpu.yaml`, its hf/)
      # on an SGLang server of its own beside the rollout's, asleep with it. Held-out reward before, at 20 and at 40
      TB=$(python3 -c "from torch.utils.tensorboard import SummaryWriter" 2>/dev/null && echo true || echo false)
      rm -rf /tmp/runs/opd
      stage opd ${OPD_LIMIT:-300} python3 -m dsrl.cli train --config configs/toy_gpu.yaml --distill.teacher_path .teacher/hf \
        --distill.server_args '{"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": true}' \
        --trainer.total_steps ${OPD_STEPS:-40} --eval.path examples/toy/test.jsonl --eval.every 20 --eval.before_train true \
        --logging.run_dir /tmp/runs/opd --logging.export_hf false --logging.tensorboard $TB
      grep -a "eval at step\|Error" "$OUT/opd.log" | sed 's/.*\[dsrl\] //' | tail -6 | tee -a "$SUMMARY"
      grep -a "final metrics" "$OUT/opd.log" | grep -o '"distill/reverse_kl": [0-9.e-]*\|"distill/teacher_seconds": [0-9.e-]*\|"reward/mean": [0-9.e-]*\|"timing/step": [0-9.e-]*' \
        | tr '\n' ' ' | tee -a "$SUMMARY"; echo | tee -a "$SUMMARY"
      ;;
    delta)  # 1 GPU (issue 86): the bf16 words an AdamW step changes and --sync.delta's encode on the GPU, per model
      # (DELTA_MODELS, random init, tools/gpu_delta.py); one summary line a model
      stage delta ${DELTA_LIMIT:-300} python3 tools/gpu_delta.py --model ${DELTA_MODELS:-1.5b 7b} --steps ${DELTA_STEPS:-10} \
        --out "$OUT/delta.json"
      grep -a "^summary\|out of GPU memory\|Error" "$OUT/delta.log" | tee -a "$SUMMARY"
      ;;
    *) note "unknown stage $s" ;;
  esac
done
if [ -d /tmp/jitcache ]; then  # the JIT caches, for .gpu/jitcache.tar.gz (carried: setup.sh unpacks it)
  tar czf "$OUT/jitcache.tar.gz" -C /tmp/jitcache . 2>/dev/null
  # A call brings back 16 MiB a file: over that, only what this machine compiled (newer than setup.sh's unpacking),
  # to merge: mkdir m; tar xzf .gpu/jitcache.tar.gz -C m; tar xzf jitcache_new.tar.gz -C m; tar czf .gpu/jitcache.tar.gz -C m .
  if [ "$(stat -c %s "$OUT/jitcache.tar.gz")" -gt 16000000 ] && [ -f /tmp/jitcache/.ok ]; then
    (cd /tmp/jitcache && find . -type f -newer .ok) | tar czf "$OUT/jitcache_new.tar.gz" -C /tmp/jitcache -T - \
      && rm "$OUT/jitcache.tar.gz"
  fi
fi
LOGS=$(mktemp -d)  # one per invocation: several may run side by side on different GPUs
mkdir -p "$LOGS/servers"
for d in /tmp/runs/*/logs /tmp/bench_async/*/logs; do
  [ -d "$d" ] && tail -c 200000 "$d"/server_0.log > "$LOGS/servers/$(basename "$(dirname "$d")").log" 2>/dev/null
done
# few files come back from $OUT: the stage logs and server logs travel as one archive
mv "$OUT"/*.log "$LOGS"/ 2>/dev/null
[ -d "$OUT/soak_servers" ] && mv "$OUT/soak_servers" "$LOGS"/
tar czf "$OUT/logs.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
echo; echo "=== summary"; cat "$SUMMARY"
