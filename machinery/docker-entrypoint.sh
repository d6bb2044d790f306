#!/usr/bin/env bash
# The GPU image's entry: say in one line whether the host's NVIDIA driver runs the image's CUDA
# torch (SPEEDRUN_MIN_DRIVER, set by the Dockerfile, or newer), then run the command. An older
# driver ends here with exit code 2; no GPU in the container runs the command on the CPU.
set -euo pipefail
need=${SPEEDRUN_MIN_DRIVER:-580}
if ! driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1) || [ -z "$driver" ]; then
    echo "speedrun image: no NVIDIA GPU in the container (run it with --gpus all); running on the CPU" >&2
elif [ "${driver%%.*}" -lt "$need" ]; then
    echo "speedrun image: the host's NVIDIA driver is $driver; this image's CUDA torch needs $need or newer: update the driver, or build the image for CUDA 12.8 (--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg MIN_DRIVER=570)" >&2
    exit 2
else
    echo "speedrun image: NVIDIA driver $driver (this image needs $need or newer)" >&2
fi
exec "$@"
