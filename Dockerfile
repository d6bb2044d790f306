# The GPU image: this repository on Python 3.12 with CUDA torch and triton (by default the GPU
# test machine's torch 2.11.0 for CUDA 13.0 and triton 3.6.0; requirements/train.txt's pins with
# --build-arg TORCH=2.13.0 --build-arg TRITON=3.7.1) and every other pin of requirements/.
#
#   docker build -t speedrun .
#   docker run --gpus all --ipc=host speedrun                               # ./run.sh
#   docker run --gpus all --ipc=host speedrun python -m pytest -q tests    # the tests
#
# Keep the downloaded FineWeb shards and the logs across runs with volumes:
#   -v $PWD/data/fineweb10B:/speedrun/data/fineweb10B -v $PWD/logs:/speedrun/logs
FROM python:3.12-slim

# Triton builds its launchers with a C compiler at first use; git names the commit in a run's log.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev git \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH=2.11.0
ARG TRITON=3.6.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /speedrun

# torch and triton from the CUDA index, then requirements.txt's other pins (its files without them).
COPY requirements.txt ./
COPY requirements/ requirements/
RUN pip install --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple \
        "torch==$TORCH" "triton==$TRITON" \
    && mkdir /tmp/pins && cp requirements/*.txt /tmp/pins/ \
    && sed -i -E '/^(torch|triton)==/d' /tmp/pins/train.txt \
    && pip install -r /tmp/pins/dev.txt \
    && rm -r /tmp/pins

COPY . .
CMD ["./run.sh"]
