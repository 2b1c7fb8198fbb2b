#!/usr/bin/env bash
# Convert an exported rk3588 folder with Rockchip's rknn-toolkit2 2.5.0 and run its graphs in the toolkit's
# simulator against onnxruntime (benchmarks/rknn_simulate.py). The toolkit pins torch <= 2.4.0, numpy <= 1.26.4,
# onnx 1.16.1-1.18.0 and protobuf <= 4.25.4, so it gets its own venv (about 5.5 GB, a few minutes to install).
#
#   bash benchmarks/rknn_simulate.sh EXPORTED_FOLDER [OUT_FOLDER]
#
# EXPORTED_FOLDER comes from `flashnext export --target rk3588`; OUT_FOLDER (default EXPORTED_FOLDER-rknn) gets a
# copy with decode.rknn / prefill.rknn and the manifest updated. RKNN_VENV picks the venv's place.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${RKNN_VENV:-$here/../.venv-rknn}"
if [ ! -x "$venv/bin/python" ]; then
  python3.11 -m venv "$venv"
  # The machine-wide pip constraints (if any) are for the project's own torch; this venv pins its own.
  PIP_CONSTRAINT= "$venv/bin/pip" install -q "rknn-toolkit2==2.5.0" "onnxruntime==1.18.1"
  # opencv-python wants a desktop's libGL; the headless build is the same cv2 without it (4.10: still numpy 1.x).
  "$venv/bin/pip" uninstall -q -y opencv-python
  # flashnext itself, for its StaticModel; numpy stays at the toolkit's 1.26
  PIP_CONSTRAINT= "$venv/bin/pip" install -q "opencv-python-headless==4.10.0.84" "numpy==1.26.4" -e "$here/.."
  # flashnext's own onnxruntime pin pulls a newer onnxruntime and protobuf 7; back to the toolkit's versions
  PIP_CONSTRAINT= "$venv/bin/pip" install -q --no-deps "onnxruntime==1.18.1" "protobuf==4.25.4"
fi
"$venv/bin/python" "$here/rknn_simulate.py" "$@"
