"""The jitted device programs and what they read: step metadata, sampling, steps.

step_batch / sampling / logit_processors (layer 1) are the step's metadata pytree and
its pure token choice; steps / speculative (5) are the static-batch forward + sample and
draft verification; serve_steps / generation (6) are the engine's programs and the
static `generate` loop; xla_options (0) the compiler options they run under.  Imports
the model, caches and attention below it; never the engine, host scheduling or text.
"""
