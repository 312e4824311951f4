# Image for the project's processes in docker-compose.yml (workers, ingest API, mock provider, ...).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY streams ./streams
COPY topics ./topics
RUN pip install --no-cache-dir .
ENTRYPOINT ["streams"]
