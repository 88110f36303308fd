"""Writes a folder of real JPEG (or PNG) files with a learnable class signal, in the layout of the ``image_folder``
dataset (``harness.neutral.image_folder.make_image_folder``): ``DIR/class_<k>/*.jpg``, or ``DIR/train/class_<k>/``
and ``DIR/test/class_<k>/`` with ``--test-per-class``. Each class has its own dominant colour and stripe angle, plus
noise, drawn from ``--seed``: the same arguments write the same images.

    python scripts/make_image_folder.py DIR --classes 2 --per-class 64 --size 64 64 --seed 0

Then ``dataset: {name: image_folder, path: DIR}`` in a spec. Exit 0, or 2 for bad arguments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the folder to write (created; existing files of the same names are "
                                               "replaced)")
    parser.add_argument("--classes", type=int, default=2, help="number of classes (default 2)")
    parser.add_argument("--per-class", type=int, default=64, help="images per class (default 64; with "
                                                                   "--test-per-class: training images per class)")
    parser.add_argument("--test-per-class", type=int, default=0,
                        help="write train/ and test/ sub-folders, with this many test images per class (default 0: "
                             "class folders only; the dataset's test_fraction splits them)")
    parser.add_argument("--size", type=int, nargs=2, default=(64, 64), metavar=("H", "W"),
                        help="height and width in pixels (default 64 64)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the images (default 0)")
    parser.add_argument("--format", choices=("jpeg", "png"), default="jpeg", help="file format (default jpeg)")
    args = parser.parse_args(argv)

    from harness.neutral.image_folder import make_image_folder

    try:
        files = make_image_folder(args.dir, classes=args.classes, per_class=args.per_class, size=tuple(args.size),
                                  seed=args.seed, image_format=args.format, test_per_class=args.test_per_class)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {len(files)} {args.format.upper()} files of {args.size[0]}x{args.size[1]} pixels in "
          f"{args.classes} classes under {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
