"""What a model is and where it comes from: the registry and its database, Modelfiles and chat templates, the
library, pulls from the hub, discovery of local weights, GGUF metadata, and how a model is loaded (engine,
context, load options)."""
