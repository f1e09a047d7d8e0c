"""OpenAI's Responses API (`/v1/responses`), as vLLM serves it: text and function tools over the chat path,
streamed as typed events, and conversations continued by `previous_response_id` from a per-tenant store.

protocol.py (wire models), convert.py (a request -> chat messages; a chat answer -> output items),
store.py (stored responses, bounded, keyed by tenant), routes.py (the endpoints and the event stream).
"""
