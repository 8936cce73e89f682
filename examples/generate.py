"""Example generation with TrtllmAttnProcessor (same as ``python -m diffusers_trtllm``).

    python examples/generate.py                      # offline CPU demo -> outputs/comparison.png
    python examples/generate.py --model black-forest-labs/FLUX.1-dev --threshold 0.05 \
        --disabled-until-timestep 0.9 --quant int8 --compare    # a real model on a GPU

The code lives in diffusers_trtllm/__main__.py so the installed package can run it too.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from diffusers_trtllm.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
