"""Training, kept out of the inference core: the corpora (the stdlib text and the code
corpus of pinned PyPI packages), the training loop and the code-completion checks."""
