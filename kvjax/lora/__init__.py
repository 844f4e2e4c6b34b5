"""LoRA adapters served per request: the projection with adapter slots that `layers.dense`
applies (weight.py) and PEFT adapters read onto a loaded model's slots (peft.py)."""
