"""How models write tool calls and reasoning, one module per family of formats.

``json_calls``: the families that write a call as a JSON object (Hermes/Qwen ``<tool_call>``, Llama 3, Mistral's
``[TOOL_CALLS][...]`` and bare JSON), recognised by one streaming state machine, since they differ only in the
marker before the JSON.
"""
