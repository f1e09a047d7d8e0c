"""OpenAI-compatible HTTP server over the async engine.

`kvserve.server.app.build_app` builds the FastAPI app; `kvserve.server.app.run_server` loads the model
and serves it with uvicorn (what `kvserve serve` and `python -m kvserve.server` run).
"""
