# kv-gateway: the gateway, the simulated engine and the planner in one image.
#   docker build -t kv-gateway .
#   docker run --rm -p 8000:8000 kv-gateway                  # the demo, as `kv-gateway demo`
#   docker run --rm -p 8000:8000 -v $PWD/config:/config kv-gateway serve --config /config/my.yaml --host 0.0.0.0
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN pip install --no-cache-dir . && useradd --create-home gateway
COPY config ./config

USER gateway
EXPOSE 8000
ENTRYPOINT ["kv-gateway"]
CMD ["demo", "--host", "0.0.0.0", "--port", "8000"]
