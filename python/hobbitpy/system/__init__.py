"""What the machine offers and how hobbitpy writes to it: disk reads and page cache, cgroup memory, the native heap, GPUs, progress bars, outputs written whole."""
