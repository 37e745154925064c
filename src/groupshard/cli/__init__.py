"""The command line: ``groupshard train`` (and ``python -m groupshard``).

The names the parser offers live here, free of torch, so that parsing imports no torch.
"""

MODEL_SIZES = ("tiny", "small", "medium")  # the keys of ``train.PRESETS``
OPTIMIZERS = ("adamw", "sgd", "lamb", "lars", "muon", "adafactor")
PRECISIONS = ("fp32", "bf16", "fp16")
