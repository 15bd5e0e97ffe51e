"""An OpenAI-compatible HTTP frontend in front of a served repository's `ensemble`.

`pipeline serve --openai-port PORT` runs it beside tritonserver (its own process, supervised). It speaks
OpenAI's chat and completions APIs (FastAPI on uvicorn, pydantic models) and calls the ensemble over gRPC,
so one frontend serves every route: the portable engine, TensorRT-LLM engines and the LLM API.

- protocol: the request and response models, and the fields refused in OpenAI's error shape.
- stops: stop strings matched on the text, across chunk boundaries.
- ensemble: one request to the ensemble as an async stream of pieces.
- app: the FastAPI application.
"""
