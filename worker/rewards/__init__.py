"""GRPO reward functions: built-ins, the custom-code sandbox, validation and group advantages.

Nothing here imports torch: rewards are plain Python over decoded completions, so the same code
is tested on the CPU and used by the GRPO engine (:mod:`worker.engine.grpo`).
"""
