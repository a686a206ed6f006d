// RET-DECODE on CUDA: the mask kernel's body, after grid.cuh and scan.cuh: the selected set, written instead of
// attended to. MLX builds its signature from the input and output names in runtime/decode/cuda.py's KERNELS.
    for (int i = tid; i < m; i += NT) sel[(size_t)r * n + tok[i]] = 1;
