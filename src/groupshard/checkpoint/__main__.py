"""``python -m groupshard.checkpoint convert CHECKPOINT OUTPUT.pt``: a sharded checkpoint
to one plain ``torch.save`` file (model state dict, plain optimizer state, extras).
``python -m groupshard.checkpoint convert OLD_CHECKPOINT NEW_FOLDER``: a checkpoint of
groupshard's first layout (every tensor 1-D) rewritten in today's (torch's names and
shapes), which FSDP2, DDP and torch's ``dcp.load`` read too.

Safe on untrusted checkpoints (nothing in them is run); a missing, damaged or crafted
checkpoint is one ``error: ...`` line naming the file, and exit status 1."""

from __future__ import annotations

import argparse
import sys

from groupshard.checkpoint.conversion import to_torch_save, upgrade


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m groupshard.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert",
        help="write one plain torch.save file (OUTPUT ends in .pt), or rewrite a "
        "checkpoint of groupshard's first layout in today's (OUTPUT a new folder)",
    )
    convert.add_argument("checkpoint", help="the directory written by gs.checkpoint.save")
    convert.add_argument("output", help="the .pt file, or the folder, to write")
    args = parser.parse_args(argv)
    try:
        if args.output.endswith(".pt"):
            to_torch_save(args.checkpoint, args.output)
        else:
            upgrade(args.checkpoint, args.output)
    except (OSError, ValueError) as error:  # CheckpointError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
