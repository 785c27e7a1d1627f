# pagedllm on CPU: `docker build -t pagedllm .` then
#   docker run -p 8000:8000 -v /srv/pagedllm:/etc/pagedllm pagedllm
# The image installs with the same `make install` that CI runs on every submission, so the
# steps below are built and tested there even where no image is.
FROM python:3.11-slim-bookworm

# g++ compiles pagedllm's C++ kernels (the level the build host serves at; a host with
# another level compiles its own at first start, into the state folder, and logs it).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --system --uid 10001 --home-dir /var/lib/pagedllm --create-home --shell /usr/sbin/nologin pagedllm

WORKDIR /opt/pagedllm
COPY pyproject.toml Makefile README.md ./
COPY src ./src

# PyTorch's CPU wheels: without this index pip would fetch the multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV TORCH_EXTENSIONS_DIR=/var/lib/pagedllm/torch_extensions
RUN make install VENV=/opt/venv PACKAGE=. TORCH_INDEX_URL=${TORCH_INDEX_URL} \
    && chown -R pagedllm: /var/lib/pagedllm

USER 10001
WORKDIR /var/lib/pagedllm
EXPOSE 8000
# Inside a container the port is published from the container's own address, so the server
# listens on every interface there; it then needs API keys (mount /etc/pagedllm with a
# keys.txt made by `pagedllm keys add NAME`), or --insecure-no-auth for a trusted network.
ENTRYPOINT ["/opt/venv/bin/pagedllm", "serve", "--host", "0.0.0.0"]
CMD ["--api-key-file", "/etc/pagedllm/keys.txt"]
