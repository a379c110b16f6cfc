#!/usr/bin/env python3
"""Write a random-weight MoE GGUF of any shape (see hobbitpy.files.synthetic_moe).

The Mixtral-style benchmark model (16 layers, 8 experts, top-2, n_embd 1024,
n_ff 4096, Q8_0, about 1.8 GB):

    python scripts/make_synthetic_moe.py synth-mixtral.gguf --arch llama --n-layer 16 \\
        --n-expert 8 --n-expert-used 2 --n-embd 1024 --n-ff 4096 --n-head 16 --n-head-kv 4
"""

from hobbitpy.files.synthetic_moe import main

if __name__ == "__main__":
    main()
