"""The engine for async callers: `AsyncEngine` steps one `LLMEngine` on its own thread (the server's
way in); kept out of `engine/`, whose core is single-threaded and knows nothing of asyncio."""
