"""Clients of a served repository's ensemble over gRPC: the blocking one behind `pipeline generate --url`, the
benchmarks and the tests (ensemble), and its asyncio twin the OpenAI frontend runs (ensemble_aio). Neither runs inside
tritonserver; the models there answer through pipeline.triton."""
