"""A request's way to an engine: the runtime (model lookup, scheduling, prompt, worker or upstream), fitting a
conversation to the context, rendering the prompt, reading the model's output formats, and diagnosing prompts that
stop matching their cache."""
