"""``funcspec serve``: the OpenAI API as vLLM serves it, over one :class:`~funcspec.Engine`.

    funcspec serve MODEL --speculative-config '{"method": "eagle3", ...}' --port 8000

Modules, each importable on its own (only :mod:`funcspec.serve.app` needs
FastAPI and uvicorn, the ``[serve]`` extra; nothing in the core package imports
this one):

- :mod:`~funcspec.serve.args`: the command line, vLLM's flag names, turned into ``LLM(...)`` arguments; the port,
  bound before the model loads; the API key (``--api-key``, ``FUNCSPEC_API_KEY``, ``VLLM_API_KEY``);
- :mod:`~funcspec.serve.protocol`: request bodies -> validated requests, OpenAI-shaped errors and
  responses, streamed text;
- :mod:`~funcspec.serve.loop`: the one engine loop (a dedicated thread steps the engine; each step's
  tokens go to per-request asyncio queues; disconnects abort);
- :mod:`~funcspec.serve.metrics`: the Prometheus metrics (``prometheus_client``);
- :mod:`~funcspec.serve.app`: the FastAPI routes and ``uvicorn``, and what SIGINT / SIGTERM do (``Shutdown``).
"""
