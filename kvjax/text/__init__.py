"""Text: tokenizers, chat templates, and tool calls in the formats models write them.

All at layer 9, beside the loaders: imports the engine's request types and below, and is
imported by the server, the evals and the command lines only.
"""
