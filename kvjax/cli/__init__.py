"""Command lines: `python -m kvjax COMMAND` (main.py dispatches), one module per command.

The top layer (11): may import anything below; nothing imports it but __main__.
"""
