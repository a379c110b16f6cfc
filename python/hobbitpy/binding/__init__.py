"""The one seam to the native libraries: libhobbit through cffi (native) and ggml's type traits (ggml)."""
