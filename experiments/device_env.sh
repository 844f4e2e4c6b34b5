# Sourced by the run_*_device.sh scripts: the device image lacks ml_collections,
# which travels as a wheel in .whl/ (carry=[".whl"]; see .library/device/README.md).
set -o pipefail
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/ml_collections-*.whl || exit 1
export PYTHONPATH=/tmp/site:.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
