#!/usr/bin/env bash
# The checks a lent GPU machine runs, in one call: the CUDA tests, then the realized, serving and generation
# benches on ["cuda:0", "cpu"]. Each step has its own time limit and log, so one that hangs or fails leaves the
# others' results. Logs go to $OUT (the device tool brings them back), or to ./gpu-logs.
#
#   tools/gpu_checks.sh                     # every step
#   tools/gpu_checks.sh tests realized      # some steps: env tests calibrate terms realized serving generate
#
# Python packages the device machine lacks (pyomo, highspy; it has torch, transformers, networkx, rich, numpy)
# travel as wheels in .whl, which git ignores (add "/.whl/" to .git/info/exclude) and the run carries:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pyomo==6.10.1 highspy==1.16.0
# Start with "env calibrate terms" (about 2 minutes): bench/RESULTS.md, "CUDA: the first runs", says why.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
steps=${*:-env tests calibrate terms realized serving generate}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    case " $steps " in *" $name "*) ;; *) return 0 ;; esac
    local begun=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local status=$?
    echo "== $name: exit $status after $((SECONDS - begun)) s (limit $limit s)"
    tail -n "${TAIL_LINES:-25}" "$out/$name.log"
}

step env 60 bash -c "nvidia-smi -L; nproc; $python -c 'import torch, transformers, pyomo, highspy, moirai;
print(torch.__version__, torch.cuda.is_available(), transformers.__version__); print(moirai.Cluster.detect())'"
step tests 180 $python -m pytest -q -p no:cacheprovider -o addopts= tests/test_cuda.py -rs --timeout 150  # one process: xdist may be absent
step calibrate 90 $python -c "from moirai.cluster.calibration.cache import local_calibration, local_request_cost
for kind, cost in local_calibration(['cuda:0', 'cpu']).items(): print(kind, cost)
print(local_request_cost())"
step terms 150 $python -m bench.prediction_terms --devices cuda:0 cpu
step realized 180 $python bench/realized.py --quick --models ${REALIZED_MODELS:-transformer two_branch_mlp gpt2} --devices cuda:0 cpu \
    --output "$out/realized.md"
step serving 120 $python -m bench.serving --quick --models mlp --devices cuda:0 cpu
step generate 120 $python -m bench.generate --quick --devices cuda:0 cpu
