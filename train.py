#!/usr/bin/env python
"""The tutorial's entry point: ``python train.py --precision fp32`` / ``python train.py --precision amp``.

A shim over ``mixprec train``; every flag of ``mixprec train --help`` works here too.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "src"))

from mixprec.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
