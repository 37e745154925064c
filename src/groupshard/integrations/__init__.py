"""Doors from the trainers people use: Hugging Face's Trainer and accelerate, Lightning.

Each module imports its library when it is imported, so ``import groupshard`` needs none
of them; ``pip install -e ".[hf]"`` installs transformers, accelerate and peft,
``pip install -e ".[lightning]"`` Lightning.
"""
