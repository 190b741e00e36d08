#!/usr/bin/env bash
# The prepared device check of the CUDA path (issue 44); see scripts/gpu_check.py.
# At most 8 minutes on a one-GPU machine; the last line is a JSON object of figures.
# Exit status: 0 all held, 1 something did not, 2 no CUDA, 124 out of time.
#
# The Python: $GPU_CHECK_PYTHON, else the first of .venv/bin/python and python3 whose
# torch sees CUDA (the repository's .venv usually holds a CPU-only torch). It needs
# torch with CUDA, pytest, pytest-timeout and nvidia-ml-py (pynvml).
set -euo pipefail
cd "$(dirname "$0")/.."

found=""
for py in "${GPU_CHECK_PYTHON:-}" .venv/bin/python python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if timeout 30 "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1; then
        found="$py"
        break
    fi
done
if [ -z "$found" ]; then
    echo "gpu_check: no Python here has a torch that sees CUDA (set GPU_CHECK_PYTHON)" >&2
    echo '{"check": "gpu", "ok": false, "failures": ["no Python with CUDA torch"]}'
    exit 2
fi
missing=$(timeout 30 "$found" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("pytest", "pytest_timeout", "pynvml") if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "gpu_check: $found lacks: $missing" >&2
    echo "{\"check\": \"gpu\", \"ok\": false, \"failures\": [\"missing: $missing\"]}"
    exit 1
fi
echo "gpu_check: using $found" >&2
exec timeout --kill-after=10 470 "$found" scripts/gpu_check.py
