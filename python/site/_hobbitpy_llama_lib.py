"""Run at interpreter start by hobbitpy-llama-lib.pth, in an environment where hobbitpy is
installed: llama-cpp-python is installed without a library of its own (hobbitpy's patched
libllama is the one llama.cpp in the process), and it reads LLAMA_CPP_LIB_PATH once, when
imported. Setting it here, before anything imports llama_cpp, makes `import llama_cpp`
work on its own and in any order with `import hobbitpy`. A path the user set wins.
Kept tiny: every interpreter of the environment runs it.
"""

import os

_lib = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hobbitpy", "lib")
if os.path.isdir(_lib):
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", _lib)
del _lib
