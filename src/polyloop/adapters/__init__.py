"""Model clients for real gateways and servers. Import each one from its own module.

* :class:`polyloop.adapters.gateway.GatewayModelClient` puts PolyGateway behind the
  :class:`~polyloop.ports.ModelClient` seam (needs the ``polygateway`` package).
* :class:`polyloop.adapters.openai.OpenAIModelClient` speaks to any server that implements
  the Chat Completions protocol: OpenAI, vLLM, Ollama, llama.cpp server (needs the
  ``openai`` extra).

This package deliberately re-exports nothing and imports neither module, so that
``import polyloop.adapters`` never needs an optional dependency: each adapter pulls in its
own third-party package only when its module is imported.
"""

__all__ = ()
