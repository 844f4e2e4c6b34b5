"""Text: tokenizers, chat templates, and tool calls in the formats models write them.

Layer 9, beside the loaders; imports nothing of kvjax outside text/ (the server, the
evals, the constraints' vocabularies and the command lines import it).
"""
