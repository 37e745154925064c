"""The command line: ``groupshard train`` (and ``python -m groupshard``).

The names the parser offers live here, free of torch, so that parsing imports no torch.
"""

MODEL_SIZES = ("tiny", "small", "medium")  # the keys of ``train.PRESETS``
OPTIMIZERS = ("adamw", "sgd", "lamb", "lars", "muon", "adafactor")
# each optimizer's default peak --lr, the best of a sweep over 100 steps of the default run
# (benchmarks/README.md); tests/test_cli.py checks that each learns with it
DEFAULT_LRS = {
    "adamw": 3e-3, "sgd": 0.1, "lamb": 0.03, "lars": 0.3, "muon": 0.02, "adafactor": 0.03,
}
PRECISIONS = ("fp32", "bf16", "fp16")
