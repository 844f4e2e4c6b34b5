"""Constrained decoding (structured outputs) with llguidance: a request's Constraint
(spec), the host matchers and packed token masks of a step (book), and a
tokenizer's vocabulary for the matcher (vocabulary).  The mask is applied on the
device by kvjax/runtime/sampling.py apply_token_mask."""
from kvjax.constraints.book import ConstraintBook
from kvjax.constraints.spec import KINDS, Constraint

__all__ = ["Constraint", "ConstraintBook", "KINDS"]
