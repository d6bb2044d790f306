# The GPU image: this repository on Python 3.12 with requirements.txt's pins: CUDA torch and the
# triton it pins from the CUDA 13.0 index, then every other pin of requirements/.
#
#   docker build -t speedrun .
#   docker run --gpus all --ipc=host speedrun                               # ./run.sh
#   docker run --gpus all --ipc=host speedrun python -m pytest -q tests    # the tests
#
# The host needs an NVIDIA driver of 580 or newer (CUDA 13.0's); the image checks it at start
# (machinery/docker-entrypoint.sh) and ends with one line when it is older. For an older driver, build for
# CUDA 12.8 (driver 570 or newer): --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
#
# Keep the downloaded FineWeb shards and the logs across runs with volumes:
#   -v $PWD/data/fineweb10B:/speedrun/data/fineweb10B -v $PWD/logs:/speedrun/logs
FROM python:3.12-slim

# Triton builds its launchers with a C compiler at first use; git names the commit in a run's log.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev git \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
# The NVIDIA driver the index's CUDA needs (machinery/docker-entrypoint.sh checks the host's): 580 for cu130.
ARG MIN_DRIVER=580
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 SPEEDRUN_MIN_DRIVER=$MIN_DRIVER
WORKDIR /speedrun

# torch and triton at their pins from the CUDA index, then requirements.txt's other pins.
COPY requirements.txt ./
COPY requirements/ requirements/
RUN pin() { sed -n "s/^$1==//p" requirements/*.txt | head -1; } \
    && pip install --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple \
        "torch==$(pin torch)" "triton==$(pin triton)" \
    && pip install -r requirements.txt

COPY . .
ENTRYPOINT ["./machinery/docker-entrypoint.sh"]
CMD ["./run.sh"]
