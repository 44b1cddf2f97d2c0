"""The OpenAI-compatible HTTP server (`kvserve serve`): FastAPI app, request/response models, handlers."""
